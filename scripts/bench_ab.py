"""Train-step time of config variants measured side by side in one process.

    python scripts/bench_ab.py --config configs/bench_cpu.py "" "model.remat=full" \
        "model.attention=xla" [--rounds 5]

Each positional argument is one variant: comma-separated KEY=VALUE config overrides ("" is
the config as it is); `config=PATH` among them takes another config file as the base (an MoE
against its dense counterpart: docs/benchmarks.md). All variants are compiled first; then
every round measures the same-process matmul peak and one step of each variant in turn, so
that slow drift of a noisy machine hits every variant alike. Prints the median and minimum
step time and the MFU of the median against the median peak (as scripts/bench_train.py defines
MFU: model FLOPs, an MoE's active ones only).
"""

from __future__ import annotations

import argparse
import time

if __name__ == "__main__":
    # Before jax is imported, so the re-executed process is the only one that loads it.
    from jaxtrain import hostmem

    hostmem.restart_with_huge_pages()  # as python -m jaxtrain.main runs

import jax
import numpy as np

from jaxtrain.config import apply_overrides, load_config_file
from jaxtrain.data.batches import make_batches, to_global
from jaxtrain.metrics import flops_per_token, measure_matmul_peak
from jaxtrain.train.setup import build


def parse_overrides(text: str) -> dict:
    overrides = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        if value in ("True", "False"):
            overrides[key] = value == "True"
        else:
            try:
                overrides[key] = int(value)
            except ValueError:
                try:
                    overrides[key] = float(value)
                except ValueError:
                    overrides[key] = value
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("variants", nargs="+")
    args = parser.parse_args()
    runs = []
    for text in args.variants:
        overrides = parse_overrides(text)
        cfg = apply_overrides(load_config_file(overrides.pop("config", args.config)), overrides)
        setup = build(cfg, jax.devices()[:1])
        state = setup.init_state()
        tokens = to_global(next(make_batches(cfg).train_iter(0)), setup.tokens_sharding)
        with jax.set_mesh(setup.mesh):
            step = setup.train_step().lower(state, tokens).compile()
            for _ in range(2):
                state, metrics = step(state, tokens)
            jax.block_until_ready(metrics)
        flops = flops_per_token(setup.spec) * cfg.train.global_batch * cfg.model.seq_len
        runs.append({"name": text or "(as is)", "setup": setup, "step": step, "state": state,
                     "tokens": tokens, "flops": flops, "times": []})
    peaks = []
    for _ in range(args.rounds):
        peaks.append(measure_matmul_peak())
        for run in runs:
            with jax.set_mesh(run["setup"].mesh):
                start = time.perf_counter()
                run["state"], metrics = run["step"](run["state"], run["tokens"])
                jax.block_until_ready(metrics)
                run["times"].append(time.perf_counter() - start)
    peak = float(np.median(peaks))
    print(f"matmul peak: median {peak / 1e12:.3f} TFLOP/s (min {min(peaks) / 1e12:.3f}, "
          f"max {max(peaks) / 1e12:.3f}) over {args.rounds} rounds")
    print("| variant | step median | step min | MFU (median step, median peak) |")
    print("|---|---|---|---|")
    for run in runs:
        median = float(np.median(run["times"]))
        print(f"| {run['name']} | {median:.3f} s | {min(run['times']):.3f} s | "
              f"{run['flops'] / median / peak:.3f} |")


if __name__ == "__main__":
    main()
