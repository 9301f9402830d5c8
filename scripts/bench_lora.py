"""LoRA against the full fine-tune of the same model, side by side in one process.

    python scripts/bench_lora.py [--config configs/bench_cpu.py] [--rank 16] \
        [--targets q,k,v,o] [--rounds 5] [--set KEY=VALUE,...]

Both variants are compiled first; then each round times one step of each in turn (slow drift
of a noisy machine hits both alike). Prints, per variant: the optimizer-state bytes, the
median and minimum step time, and the peak memory of the compiled step (XLA's
memory_analysis: arguments + outputs − donated aliases + temporaries); then LoRA's ratios to
the full fine-tune (issue #28 part 7: optimizer state ≤ 5%, step time ≤ 1, peak lower).
A short check: --set model.num_layers=2,model.seq_len=128 --rounds 2.
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
from bench_ab import parse_overrides

from jaxtrain.config import apply_overrides, load_config_file
from jaxtrain.data.batches import make_batches, to_global
from jaxtrain.train.setup import build


def _peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def _variant(name: str, cfg) -> dict:
    setup = build(cfg, jax.devices()[:1])
    state = setup.init_state()
    tokens = to_global(next(make_batches(cfg).train_iter(0)), setup.tokens_sharding)
    with jax.set_mesh(setup.mesh):
        step = setup.train_step().lower(state, tokens).compile()
        for _ in range(2):
            state, metrics = step(state, tokens)
        jax.block_until_ready(metrics)
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    return {"name": name, "setup": setup, "step": step, "state": state, "tokens": tokens,
            "opt_bytes": opt_bytes, "peak": _peak_bytes(step), "times": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench_cpu.py")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q,k,v,o")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set", default="", help="KEY=VALUE,... for both variants")
    args = parser.parse_args()
    base = apply_overrides(load_config_file(args.config), parse_overrides(args.set))
    lora = apply_overrides(load_config_file(args.config), {
        **parse_overrides(args.set), "model.lora.rank": args.rank,
        "model.lora.targets": args.targets})
    runs = [_variant("full", base), _variant(f"lora r={args.rank} {args.targets}", lora)]
    for _ in range(args.rounds):
        for run in runs:
            with jax.set_mesh(run["setup"].mesh):
                start = time.perf_counter()
                run["state"], metrics = run["step"](run["state"], run["tokens"])
                jax.block_until_ready(metrics)
                run["times"].append(time.perf_counter() - start)
    for run in runs:
        t = np.asarray(run["times"])
        print(f"{run['name']:<28} optimizer state {run['opt_bytes'] / 1e6:10.2f} MB  step "
              f"median {np.median(t) * 1e3:8.1f} ms (min {t.min() * 1e3:.1f})  peak compiled "
              f"{run['peak'] / 1e6:9.1f} MB")
    full, adapted = runs
    print(f"lora/full: optimizer state {adapted['opt_bytes'] / full['opt_bytes']:.2%}, step "
          f"time {np.median(adapted['times']) / np.median(full['times']):.3f}, peak compiled "
          f"memory {adapted['peak'] / full['peak']:.3f}")


if __name__ == "__main__":
    main()
