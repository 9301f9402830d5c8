"""Throughput, MFU and compiled memory of one config's train step (compile excluded).

    python scripts/bench_train.py --config configs/bench_cpu.py [--config.KEY=VALUE ...] [--json]
    python scripts/bench_train.py --config configs/bench_cpu.py --sweep [--attentions=xla,chunked]
        [--remats=none,full] [--precisions=float32,bfloat16]

MFU is model FLOPs/s (jaxtrain.models.flops.flops_per_token) over the devices' peak: on CPU a
jitted 2048×2048 matmul measured in this same process, on known accelerators the datasheet
(and, as `mfu_vs_measured`, an 8192² matmul in the compute dtype measured in this process).
--against torch also runs scripts/bench_torch.py (the same shape in plain PyTorch, eager and
torch.compile, on the same batches), alternating the three for --rounds rounds, each in a
fresh process but the first, and prints each one's median tokens/s and jaxtrain's ratio to it.
--sweep benchmarks every combination of attention × remat × precision and prints a table
(tokens/s, MFU, XLA memory per device) and, with --json, one JSON object per line.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import math
import re
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps (after 2 warm-up steps).")
_SWEEP = flags.DEFINE_bool("sweep", False, "Benchmark attention × remat × precision.")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False, "Compile and report XLA's memory "
                                  "analysis without running a step (for shapes too big to run).")
_AGAINST = flags.DEFINE_enum("against", None, ["torch"], "Also time the PyTorch peer "
                              "(scripts/bench_torch.py, eager and torch.compile) and print "
                              "the ratios.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "--against: rounds of (jaxtrain, torch.compile, "
                               "torch eager), alternated so that drift hits all three alike.")
_ATTENTIONS = flags.DEFINE_list("attentions", None, "Sweep: attention implementations "
                                "(default: all that run on this backend).")
_REMATS = flags.DEFINE_list("remats", None, "Sweep: remat policies (default: all).")
_PRECISIONS = flags.DEFINE_list("precisions", None, "Sweep: precision policies (default: all).")
flags.mark_flags_as_required(["config"])


def saved_activation_bytes(setup, state, tokens) -> int:
    """Bytes the loss's backward pass keeps from its forward pass (the parameters and the
    batch themselves not counted): the activation memory that remat policies trade for
    recomputation, as jax.ad_checkpoint.print_saved_residuals lists it."""
    from jax import ad_checkpoint

    from jaxtrain.train.step import loss_fn

    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        ad_checkpoint.print_saved_residuals(
            lambda params: loss_fn(params, setup.graphdef, tokens), state.params)
    total = 0
    for line in listing.getvalue().splitlines():
        aval, _, source = line.partition(" ")
        if source.startswith("from the argument"):
            continue
        kind = re.match(r"([a-z]+)(\d*)\[([\d,]*)\]", aval)
        bits = int(kind.group(2) or 8)
        total += math.prod(int(d) for d in kind.group(3).split(",") if d) * bits // 8
    return total


def bench(cfg, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxtrain.data.batches import make_batches, to_global
    from jaxtrain.metrics import flops_per_token, measure_matmul_peak, peak_flops_per_device
    from jaxtrain.plan.compile_check import compile_step, memory_figures
    from jaxtrain.train.setup import build

    setup = build(cfg)
    mesh, spec = setup.mesh, setup.spec
    state = setup.init_state()
    data = make_batches(cfg).train_iter(0)
    tokens = [to_global(next(data), setup.tokens_sharding) for _ in range(2)]
    t0 = time.perf_counter()
    step = compile_step(setup, state, tokens[0])
    compile_s = time.perf_counter() - t0
    memory = memory_figures(step)
    memory_row = {"memory_argument_bytes": int(memory["argument_bytes"]),
                  "memory_output_bytes": int(memory["output_bytes"]),
                  "memory_temp_bytes": int(memory["temp_bytes"]),
                  "memory_total_bytes": int(memory["total_bytes_per_device"])}
    if _COMPILE_ONLY.value:
        with jax.set_mesh(mesh):
            saved = saved_activation_bytes(setup, state, tokens[0])
        return {"config": cfg.name, "attention": spec.attention, "remat": cfg.model.remat,
                "precision": cfg.train.precision, "seq_len": cfg.model.seq_len,
                "compile_s": compile_s, "saved_activation_bytes": saved, **memory_row}
    with jax.set_mesh(mesh):
        for i in range(2):
            state, metrics = step(state, tokens[i % 2])
        jax.block_until_ready(metrics)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            state, metrics = step(state, tokens[i % 2])
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
    peak, peak_source = peak_flops_per_device(cfg.train.precision)
    measured = None
    if jax.devices()[0].platform != "cpu":
        dtype = jnp.bfloat16 if cfg.train.precision != "float32" else jnp.float32
        measured = measure_matmul_peak(dtype, n=8192)
    step_time = float(np.median(times))
    tokens_per_s = cfg.train.global_batch * cfg.model.seq_len / step_time
    model_flops = flops_per_token(spec) * tokens_per_s
    return {
        "config": cfg.name,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "tokens_per_s": tokens_per_s,
        "step_time_s": step_time,
        "step_time_min_s": float(np.min(times)),
        "model_tflops": model_flops / 1e12,
        "peak_tflops_per_device": peak / 1e12,
        "peak_source": peak_source,
        "mfu": model_flops / (peak * jax.device_count()),
        "mfu_vs_measured": (model_flops / (measured * jax.device_count())
                            if measured else None),
        "attention": spec.attention,
        "remat": cfg.model.remat,
        "precision": cfg.train.precision,
        "compile_s": compile_s,
        **memory_row,
        "loss": float(metrics["loss"]),
    }


def sweep(cfg, steps: int) -> list[dict]:
    import jax

    from jaxtrain.models.attention import KERNELS
    from jaxtrain.models.remat import REMATS
    from jaxtrain.precision import PRECISIONS

    platform = jax.devices()[0].platform
    attentions = _ATTENTIONS.value or [  # the kernels that run natively here
        name for name, k in KERNELS.items()
        if platform in k.platforms and platform not in k.interpreted]
    rows = []
    for attention, remat, precision in itertools.product(
            attentions, _REMATS.value or [r for r, e in REMATS.items() if platform in e.platforms],
            _PRECISIONS.value or PRECISIONS):
        variant = copy.deepcopy(cfg)
        variant.model.attention, variant.model.remat = attention, remat
        variant.train.precision = precision
        try:
            rows.append(bench(variant, steps))
        except Exception as e:  # noqa: BLE001 - one failing combination is a result too
            rows.append({"attention": attention, "remat": remat, "precision": precision,
                         "error": str(e).splitlines()[0][:200]})
        if _JSON.value:
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| attention | remat | precision | tokens/s | step s | MFU | args MiB | temp MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['attention']} | {r['remat']} | {r['precision']} | error: "
                  f"{r['error']} | | | | |")
            continue
        print(f"| {r['attention']} | {r['remat']} | {r['precision']} | "
              f"{r['tokens_per_s']:.4g} | {r['step_time_s']:.3g} | {r['mfu']:.3f} | "
              f"{r['memory_argument_bytes'] / 2**20:.0f} | {r['memory_temp_bytes'] / 2**20:.0f} |")


def _config_args(argv: list[str]) -> list[str]:
    """The --config flag and its overrides, each as one `--KEY=VALUE` word: absl also takes
    `--config PATH` as two words, and the peer must not read the path as a flag."""
    out, words = [], iter(argv)
    for word in words:
        if not word.startswith("--config"):
            continue
        if "=" not in word:
            word = f"{word}={next(words, '')}"
        out.append(word)
    return out


def _torch_peer(mode: str) -> dict:
    """scripts/bench_torch.py in a child process, with this run's config and overrides."""
    import os
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_torch.py")
    passed = _config_args(sys.argv[1:])
    out = subprocess.run([sys.executable, script, *passed, f"--mode={mode}",
                          f"--steps={_STEPS.value}", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def against_torch(cfg) -> list[dict]:
    """jaxtrain, torch.compile and torch eager, alternated for --rounds rounds; one row per
    implementation with its median tokens/s over the rounds and jaxtrain's ratio to it."""
    import statistics

    runs = {"jaxtrain": [], "torch compile": [], "torch eager": []}
    for _ in range(_ROUNDS.value):
        runs["jaxtrain"].append(bench(cfg, _STEPS.value))
        runs["torch compile"].append(_torch_peer("compile"))
        runs["torch eager"].append(_torch_peer("eager"))
    ours = statistics.median(r["tokens_per_s"] for r in runs["jaxtrain"])
    rows = []
    for impl, results in runs.items():
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in results)
        rows.append({"impl": impl, "tokens_per_s": tokens_per_s,
                     "each": [round(r["tokens_per_s"], 1) for r in results],
                     "jaxtrain_ratio": ours / tokens_per_s,
                     **({"mfu": statistics.median(r["mfu"] for r in results)}
                        if impl == "jaxtrain" else {})})
    return rows


def main(argv) -> None:
    del argv
    if _AGAINST.value:
        load = __import__("os").getloadavg()
        rows = against_torch(_CONFIG.value)
        if _JSON.value:
            print(json.dumps(rows))
            return
        print(f"load average before: {load}, after: {__import__('os').getloadavg()}")
        print("| implementation | tokens/s (median) | each round | jaxtrain / it |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['impl']} | {r['tokens_per_s']:.4g} | {r['each']} | "
                  f"{r['jaxtrain_ratio']:.3f} |")
        print(f"jaxtrain MFU (median): {rows[0]['mfu']:.3f}")
        return
    if _SWEEP.value:
        rows = sweep(_CONFIG.value, _STEPS.value)
        if not _JSON.value:
            print_table(rows)
        return
    result = bench(_CONFIG.value, _STEPS.value)
    if _JSON.value:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>24}: {value:.4g}" if isinstance(value, float) else f"{key:>24}: {value}")


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(
        __import__("os").path.abspath(__file__))))
    from jaxtrain import hostmem
    from jaxtrain.commands.common import parse_flags

    hostmem.restart_with_huge_pages()  # as python -m jaxtrain.main runs
    app.run(main, flags_parser=parse_flags)
