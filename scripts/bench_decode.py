"""Decode speed of the generation engine beside transformers' generate, on one device.

    python scripts/bench_decode.py [--batches 1,32] [--new_tokens 128] [--skewed 64]
        [--precision bfloat16] [--threads N] [--skip_torch] [--lower_cuda] [--json]

A random Llama of SmolLM-135M's shape (576 wide, 30 layers, 9 query / 3 kv heads, MLP 1536,
vocabulary 49152, the head tied to the embedding on both sides) measured four ways:

1. tokens/s at each --batches size: that many prompts of --prompt_len random ids, each
   decoding --new_tokens greedy tokens (no EOS), compile excluded (a first run compiles),
   the best of --repeats; transformers `generate` of the same shape on the same host threads
   (torch.set_num_threads(--threads)).
2. the memory-bandwidth bound at batch 1: every weight and the slot's cache read once per
   token, against --bandwidth_gbps, else the device's catalog bandwidth
   (jaxtrain/hardware.json), else the host's read bandwidth measured here (a CPU): the
   engine's fraction of it.
3. a skewed workload: --skewed requests with prompt and output lengths drawn from 16..512
   (seeded), through --slots slots: continuous batching (a slot takes the next request when
   its own ends) against static batching (--slots requests at a time, each batch waiting for
   its longest), both on the same engine and compiled functions (compiled first: each
   prefill bucket and each step's key bucket; each timed once).
4. --lower_cuda: the decode step lowered for CUDA (no GPU needed): its custom calls and host
   callbacks (there should be none), as scripts/accelerator/cuda_lowering_check.py does for
   the train step.

Runs for minutes at the full shape on a CPU: the lead runs it on a quiet machine; for a
smoke test, --layers 2 --d_model 64 --heads 4 --kv_heads 2 --mlp 128 --vocab 256.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain import hardware  # noqa: E402
from jaxtrain.config import base_config  # noqa: E402
from jaxtrain.engine import Engine, Model, Request, SamplingParams  # noqa: E402
from jaxtrain.engine.sampler import RowSampling  # noqa: E402
from jaxtrain.engine.steps import bucket, key_bucket  # noqa: E402
from jaxtrain.train.setup import build  # noqa: E402


def _config(a):
    c = base_config()
    m = c.model
    m.family, m.d_model, m.num_layers, m.num_heads = "llama", a.d_model, a.layers, a.heads
    m.num_kv_heads, m.mlp_dim, m.vocab_size, m.seq_len = a.kv_heads, a.mlp, a.vocab, a.seq_len
    m.head_dim, m.tie_embeddings = a.d_model // a.heads, True
    c.train.precision, c.train.global_batch = a.precision, 1
    return c


def _model(a) -> Model:
    setup = build(_config(a), jax.devices()[:1])
    with jax.set_mesh(setup.mesh):
        params = setup.init_state().params
    return Model(setup.graphdef, params, setup.mesh, setup.spec.rules, a.vocab, a.seq_len)


def _timed(run, repeats: int, compile_first: bool = True) -> float:
    if compile_first:
        run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def engine_rate(model: Model, batch: int, a) -> float:
    engine = Engine(model, slots=batch, max_len=a.prompt_len + a.new_tokens)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    requests = [Request(tuple(rng.integers(0, a.vocab, a.prompt_len).tolist()), params)
                for _ in range(batch)]
    return batch * a.new_tokens / _timed(lambda: engine.generate(requests), a.repeats)


def torch_rate(batch: int, a) -> float:
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    config = transformers.LlamaConfig(
        hidden_size=a.d_model, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, intermediate_size=a.mlp, vocab_size=a.vocab,
        max_position_embeddings=a.seq_len, tie_word_embeddings=True)
    dtype = torch.bfloat16 if a.precision == "bfloat16" else torch.float32
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, a.vocab, (batch, a.prompt_len))

    def run():
        with torch.no_grad():
            model.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                           do_sample=False, pad_token_id=0)

    return batch * a.new_tokens / _timed(run, a.repeats)


def measured_gbps(gib: float = 1.0, repeats: int = 5) -> float:
    """The device's read bandwidth: the best of `repeats` sums of `gib` GiB of float32 (a
    read-only stream, as a decode step reads its weights)."""
    x = jax.numpy.ones(int(gib * 2**30) // 4, jax.numpy.float32)
    total = jax.jit(jax.numpy.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def bandwidth_bound(model: Model, a) -> dict:
    """Tokens/s at batch 1 if a step only read every weight and the slot's cache once, at
    --bandwidth_gbps, else the device's catalog bandwidth, else the host's measured one."""
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    engine = Engine(model, slots=1, max_len=a.prompt_len + a.new_tokens)
    cache = sum(x.nbytes for x in jax.tree.leaves(engine.cache))
    device = jax.devices()[0]
    name = hardware.for_device_kind(device.device_kind)
    if a.bandwidth_gbps:
        gbps, source = a.bandwidth_gbps, "--bandwidth_gbps"
    elif name:
        gbps, source = hardware.get(name).memory_bw_gbps, f"catalog: {name}"
    else:
        gbps, source = measured_gbps(), "measured: the best of 5 sums of 1 GiB of float32"
    return {"weight_bytes": weights, "cache_bytes_per_slot": cache,
            "device": device.device_kind, "bandwidth_gbps": gbps, "bandwidth_source": source,
            "bound_tokens_per_s": gbps * 1e9 / (weights + cache)}


def skewed(model: Model, a) -> dict:
    """(continuous, static) tokens/s of --skewed requests of skewed lengths."""
    rng = np.random.default_rng(1)
    requests = [Request(tuple(rng.integers(0, a.vocab, int(rng.integers(16, 513))).tolist()),
                        SamplingParams(max_new_tokens=int(rng.integers(16, 513)),
                                       ignore_eos=True)) for _ in range(a.skewed)]
    tokens = sum(r.params.max_new_tokens for r in requests)
    engine = Engine(model, slots=a.slots, max_len=1024)
    # Compiles first: one short request per prefill bucket, one step per key bucket. The
    # timed runs (one each) compile nothing, and the workload runs twice, not four times.
    one = {bucket(len(r.prompt_ids) - 1, engine.max_len): r for r in requests}
    engine.generate([Request(r.prompt_ids, SamplingParams(max_new_tokens=2, ignore_eos=True))
                     for r in one.values()])
    rows = RowSampling(**engine.rows)
    with jax.set_mesh(model.mesh):
        for keys in sorted({key_bucket(n, engine.max_len) for n in range(1, engine.max_len + 1)}):
            engine.cache = engine.steps.step(model.params, engine.cache, engine.tokens_S,
                                             engine.positions_S, rows, keys=keys)[0]

    def static():
        for start in range(0, len(requests), a.slots):
            engine.generate(requests[start:start + a.slots])

    return {"requests": len(requests), "new_tokens": tokens, "slots": a.slots,
            "continuous_tokens_per_s": tokens / _timed(lambda: engine.generate(requests), 1,
                                                       compile_first=False),
            "static_tokens_per_s": tokens / _timed(static, 1, compile_first=False)}


def lower_cuda(model: Model) -> dict:
    """The decode step lowered for CUDA: its custom-call targets and host callbacks."""
    engine = Engine(model, slots=8, max_len=256)
    rows = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in engine.rows.items()}
    args = (model.params, engine.cache, jax.ShapeDtypeStruct((8,), np.int32),
            jax.ShapeDtypeStruct((8,), np.int32), RowSampling(**rows))
    with jax.set_mesh(model.mesh):
        text = engine.steps.step.trace(*args, keys=128).lower(
            lowering_platforms=("cuda",)).as_text()
    targets = re.findall(r'custom_call @(\w+)|call_target_name = "([^"]+)"', text)
    names = sorted({a or b for a, b in targets})
    # each matmul's operand types: (tensor<...xbf16>, tensor<...xbf16>) -> ...
    dots = re.findall(r"dot_general.*?: \(tensor<(?:[\d?]+x)*(\w+)>, "
                      r"tensor<(?:[\d?]+x)*(\w+)>\)", text)
    return {"custom_calls": names, "host_callbacks": [n for n in names if "callback" in n],
            "matmul_operand_types": dict(collections.Counter(f"{a}x{b}" for a, b in dots))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 30), ("d_model", 576), ("heads", 9), ("kv_heads", 3),
                          ("mlp", 1536), ("vocab", 49152), ("seq_len", 2048),
                          ("prompt_len", 64), ("new_tokens", 128), ("skewed", 64),
                          ("slots", 32), ("repeats", 2), ("threads", os.cpu_count())):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--bandwidth_gbps", type=float, default=0.0)
    for flag in ("skip_torch", "lower_cuda", "json"):
        p.add_argument(f"--{flag}", action="store_true")
    a = p.parse_args()
    model = _model(a)
    out = {"shape": {k: getattr(a, k) for k in ("layers", "d_model", "heads", "kv_heads",
                                                "mlp", "vocab", "precision")}, "rates": []}
    for batch in map(int, a.batches.split(",")):
        row = {"batch": batch, "engine_tokens_per_s": engine_rate(model, batch, a)}
        if not a.skip_torch:
            row["transformers_tokens_per_s"] = torch_rate(batch, a)
            row["speedup"] = row["engine_tokens_per_s"] / row["transformers_tokens_per_s"]
        out["rates"].append(row)
    out["bandwidth"] = bandwidth_bound(model, a)
    if out["rates"][0]["batch"] == 1:
        out["bandwidth"]["fraction_at_batch_1"] = \
            out["rates"][0]["engine_tokens_per_s"] / out["bandwidth"]["bound_tokens_per_s"]
    if a.skewed:
        out["skewed"] = skewed(model, a)
    if a.lower_cuda:
        out["cuda_lowering"] = lower_cuda(model)
    print(json.dumps(out, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
