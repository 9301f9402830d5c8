"""Shared by the tests: train steps on a chosen set of devices (`stepping`, the one loop),
the attention kernels' inputs and the float64 numpy attention every kernel is checked
against, the export, PEFT and greedy-decoding checks of the convert tests (their
transformers side: hf_parity.py), and several `jaxtrain` commands in one process
(`run_commands`)."""

import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
from flax import nnx

from jaxtrain.data.batches import make_batches, to_global
from jaxtrain.train.setup import build
from jaxtrain.train.state import abstract_model

ROOT = pathlib.Path(__file__).resolve().parents[1]


def stepping(setup, state, batches):
    """(state, metrics) after each train step of `setup` from `state`, one step a batch of
    `batches` (host batches, put on the mesh here), under the mesh: the loop of every test
    that trains a few steps. Read it to the end (a for loop or a list), so the mesh is left."""
    with jax.set_mesh(setup.mesh):
        step = setup.train_step()
        for batch in batches:
            state, metrics = step(state, to_global(batch, setup.tokens_sharding))
            yield state, metrics


def first_batches(cfg, count: int):
    """The first `count` training batches of cfg's data."""
    return itertools.islice(make_batches(cfg).train_iter(0), count)


def train_steps(cfg, devices, steps: int = 3, count_work=None):
    """(per-step losses, final params as numpy, final state) of `steps` steps from init.
    count_work: under mesh.context, called (device, FLOPs) by every attention tile the
    compiled step computes (ContextSpec.count_work)."""
    setup = build(cfg, devices)
    if count_work is not None:
        setup = counting_work(setup, count_work)
    after = list(stepping(setup, setup.init_state(), first_batches(cfg, steps)))
    state = after[-1][0]
    return [float(m["loss"]) for _, m in after], jax.tree.map(np.asarray, state.params), state


def counting_work(setup, count_work):
    """setup with its context-parallel attention counting its work: the spec carries the
    counter, and the model (its graphdef) is rebuilt from that spec."""
    context = dataclasses.replace(setup.spec.context, count_work=count_work)
    spec = dataclasses.replace(setup.spec, context=context)
    return dataclasses.replace(setup, spec=spec, graphdef=nnx.graphdef(abstract_model(spec)))


def assert_params_close(a, b, rtol=1e-5):
    """Each parameter tensor within rtol of the reference, as ‖a−b‖/‖b‖.

    A per-tensor norm rather than per element: Adam divides each gradient entry by its own
    magnitude, so an entry whose gradient is nearly zero turns float reassociation (a
    different reduction order on another mesh) into an O(lr·1e-3) change of that one entry.
    """
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b):
        err = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-12)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e} > {rtol}"


def assert_cached_decoding_matches_full_forward(setup, params, prefill: int = 12,
                                                length: int = 16):
    """The kv-cached decode (a prefill of `prefill` tokens, then one token at a time) gives
    the full forward's logits of `length` random tokens."""
    import jax.numpy as jnp
    from flax import nnx

    tokens = jax.random.randint(jax.random.key(1), (1, length), 0, 256)
    with jax.set_mesh(setup.mesh):
        full = jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(params, tokens)

        @jax.jit
        def cached(p, t):
            model = nnx.merge(setup.graphdef, p)
            cache = model.init_cache(1, length)
            logits, cache = model.decode(t[:, :prefill], cache, jnp.int32(0))
            steps = [logits]
            for i in range(prefill, length):
                logits, cache = model.decode(t[:, i:i + 1], cache, jnp.int32(i))
                steps.append(logits)
            return jnp.concatenate(steps, axis=1)

        got = cached(params, tokens)
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5 * float(jnp.abs(full).max()))


def attention_inputs(b, length, heads, groups, head_dim, seed=0, q_scale=0.5, k_scale=0.5):
    """The attention kernel tests' inputs, seeded: q [b, length, heads, head_dim], k and v
    [b, length, groups, head_dim] and a cotangent of q's shape, normal; q and k scaled."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, length, heads, head_dim)) * q_scale
    k = jax.random.normal(keys[1], (b, length, groups, head_dim)) * k_scale
    v = jax.random.normal(keys[2], (b, length, groups, head_dim))
    cotangent = jax.random.normal(keys[3], (b, length, heads, head_dim))
    return q, k, v, cotangent


def relative_error(a, b) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def attention_f64(q_BLHK, k_BMGK, v_BMGK, window=None, segments_BL=None, cotangent_BLHK=None):
    """Causal grouped-query attention in float64 numpy, independent of the package's kernels:
    (output, and with a cotangent the gradients (dq, dk, dv) of <output, cotangent>).

    Query i sees key j when j <= i, j > i - window (a sliding window) and, with document
    ids, when both carry the same id. Queries are taken as already scaled, as the kernels
    take them. The backward is the textbook one: dV = P^T dO, dS = P * (dP - rowsum(dP * P)).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q_BLHK, k_BMGK, v_BMGK))
    b, length, heads, _ = q.shape
    groups, keys = k.shape[2], k.shape[1]
    rep = heads // groups
    k_BMHK, v_BMHK = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    i, j = np.arange(length)[:, None], np.arange(keys)[None, :]
    visible_BLM = np.broadcast_to((j <= i) & ((j > i - window) if window else True),
                                  (b, length, keys))
    if segments_BL is not None:
        ids = np.asarray(segments_BL)
        visible_BLM = visible_BLM & (ids[:, :, None] == ids[:, None, :keys])
    scores_BHLM = np.einsum("blhk,bmhk->bhlm", q, k_BMHK)
    scores_BHLM = np.where(visible_BLM[:, None], scores_BHLM, -np.inf)
    scores_BHLM -= scores_BHLM.max(-1, keepdims=True)
    probs_BHLM = np.exp(scores_BHLM)
    probs_BHLM /= probs_BHLM.sum(-1, keepdims=True)
    out_BLHK = np.einsum("bhlm,bmhk->blhk", probs_BHLM, v_BMHK)
    if cotangent_BLHK is None:
        return out_BLHK
    dout = np.asarray(cotangent_BLHK, np.float64)
    dv_BMHK = np.einsum("bhlm,blhk->bmhk", probs_BHLM, dout)
    dprobs_BHLM = np.einsum("blhk,bmhk->bhlm", dout, v_BMHK)
    dscores_BHLM = probs_BHLM * (dprobs_BHLM - (dprobs_BHLM * probs_BHLM).sum(-1, keepdims=True))
    dq = np.einsum("bhlm,bmhk->blhk", dscores_BHLM, k_BMHK)
    dk_BMHK = np.einsum("bhlm,blhk->bmhk", dscores_BHLM, q)

    def per_group(x_BMHK):  # the repeated heads' gradients add up in their kv head
        return x_BMHK.reshape(b, keys, groups, rep, -1).sum(3)

    return out_BLHK, (dq, per_group(dk_BMHK), per_group(dv_BMHK))


def assert_exports_bitwise(tmp_path, devices, model, hf_logits, tokens, want, **load_kwargs):
    """The run in tmp_path/run exported to tmp_path/out loads in AutoModelForCausalLM as
    `model`'s class with logits `want`, and its tensors are bitwise the imported
    tmp_path/hf's (the convert tests' export round trip)."""
    import transformers
    from safetensors.numpy import load_file

    from jaxtrain.hf.save import export_hf

    export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    # AutoModelForCausalLM, or where it has no entry for the config (Mistral 4) the class
    # config.json's `architectures` names.
    auto, config = transformers.AutoModelForCausalLM, transformers.AutoConfig.from_pretrained(
        tmp_path / "out")
    loader = (auto if type(config) in auto._model_mapping
              else getattr(transformers, config.architectures[0]))
    again = loader.from_pretrained(tmp_path / "out", **load_kwargs).eval()
    assert type(again) is type(model)
    np.testing.assert_array_equal(hf_logits(again, tokens), want)
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(np.array_equal(exported[k], original[k]) for k in original)


def hf_llama(cfg):
    """A transformers Llama of `cfg.model`'s shape with weights drawn N(0, 0.1) (norms
    around 1), seeded: the independent reference the LoRA and frozen-base tests import."""
    import torch
    import transformers

    m = cfg.model
    config = transformers.LlamaConfig(
        hidden_size=m.d_model, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, intermediate_size=m.mlp_dim,
        vocab_size=m.vocab_size, max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    return model.eval()


def assert_peft_loads_the_adapter(tmp_path, devices, config, hf_model, targets: str,
                                  peft_names: list[str], atol: float = 1e-5, **load_kwargs):
    """A LoRA run on `targets` of a base imported from `hf_model(config())` (a transformers
    model), trained a few steps: the exported adapter's target modules are `peft_names`, and
    PEFT on the transformers base gives jaxtrain's logits of the run (within atol), which
    the trained adapters moved. config(**overrides): the family's tiny config."""
    import json

    import jax
    import transformers
    from flax import nnx
    from hf_parity import hf_logits, random_tokens
    from peft import PeftModel

    from jaxtrain.hf.load import import_hf
    from jaxtrain.hf.save import export_hf, load_for_export
    from jaxtrain.train.loop import run

    base_cfg = config()
    hf_model(base_cfg).save_pretrained(tmp_path / "hf")
    import_hf(base_cfg, tmp_path / "hf", tmp_path / "base", devices[:1])
    cfg = config(**{"model.lora.rank": 4, "model.lora.alpha": 8.0,
                    "model.lora.targets": targets, "model.lora.base": str(tmp_path / "base"),
                    "optimizer.lr": 1e-2})
    run(cfg, tmp_path / "run", devices[:1])
    export_hf(tmp_path / "run", tmp_path / "adapter", devices=devices[:1], adapter=True)
    exported = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(exported["target_modules"]) == sorted(peft_names)
    setup, params, _ = load_for_export(tmp_path / "run", devices[:1])
    tokens = random_tokens(cfg, batch=4)
    with jax.set_mesh(setup.mesh):
        ours = np.asarray(jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(params, tokens))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                             **load_kwargs).eval()
    before = hf_logits(base, tokens)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(hf_logits(peft_model, tokens), ours, atol=atol, rtol=0)
    assert np.abs(before - ours).max() > 1e-3  # the trained adapters change the logits


def assert_greedy_decode_equals_transformers(setup, state, model, new_tokens: int = 30):
    """`new_tokens` greedy tokens of jaxtrain's cached decode (state: an import of `model`,
    a transformers model) equal transformers' generate from one 5-token prompt, and are not
    one token repeated."""
    import jax
    import torch

    from jaxtrain.sampling import Sampling, make_generate

    prompt = np.asarray([[5, 17, 42, 7, 99]], np.int64)
    with torch.no_grad():
        want = model.generate(torch.from_numpy(prompt), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0,
                              eos_token_id=None).numpy()[0, prompt.shape[1]:]
    with jax.set_mesh(setup.mesh):
        generate = make_generate(setup.graphdef, Sampling(max_new_tokens=new_tokens),
                                 setup.spec.rules)
        got = np.asarray(generate(state.params, prompt.astype(np.int32), jax.random.key(0)))[0]
    np.testing.assert_array_equal(got, want)
    assert len(set(got.tolist())) > 2


def losses_and_norms(setup, state, batches) -> list[tuple[float, float]]:
    """[(loss, grad_norm)] of a train step on each of `batches` in turn, from `state`."""
    return [(float(m["loss"]), float(m["grad_norm"])) for _, m in stepping(setup, state, batches)]


def jaxtrain_steps(cfg, setup, state, count: int = 20):
    """(the batches, [(loss, grad_norm)] of each step) of `count` jaxtrain train steps from
    `state` on cfg's data: the jaxtrain side of the 20-step parity tests."""
    batches = [np.asarray(getattr(b, "tokens", b)) for b in first_batches(cfg, count)]
    return batches, losses_and_norms(setup, state, batches)


# One process runs each argv through the `jaxtrain` dispatcher in turn, catching its
# SystemExit and the Python-level output. After each it drops the flags the command defined
# and its module (a command that defines its flags at import gets them afresh, unparsed):
# a refusal needs no process of its own (each is ~3 s of imports on 2 busy cores).
_DRIVER = """import contextlib, io, json, sys
from absl import app, flags, logging  # their own flags stay
from jaxtrain.commands import COMMANDS, main
results = []
for argv in json.loads(sys.argv[1]):
    before, out, err, code = set(flags.FLAGS), io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code
    for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)
    if argv and argv[0] in COMMANDS:
        sys.modules.pop("jaxtrain.commands." + COMMANDS[argv[0]][0], None)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_commands(argvs: list[list[str]], cwd) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `jaxtrain ARGV...` for each argv, in one process.
    Anything written past Python's streams (a C++ warning to file descriptor 2) fails the
    test: a command's stderr must be its one line."""
    env = dict(os.environ, JAXTRAIN_HUGE_PAGES="0",  # no re-exec of the driver
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not out.stderr.strip(), out.stderr[-3000:]
    return [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]
