"""CPU train-step tokens/s and compiled memory of the tiny hybrid (configs/tiny_qwen3_5.py:
3 Gated DeltaNet layers : 1 full attention) against the same model with every layer full
attention, at several sequence lengths, and the hybrid at several chunk sizes.

    python scripts/bench_hybrid.py [--lengths 512,2048,8192] [--chunks 32,64,128]
        [--rounds 3] [--batch 1]

Each variant is compiled first (its compiled memory: arguments + outputs − donated aliases +
temporaries, memory_analysis), then `rounds` rounds time one step of each variant in turn,
so that a noisy machine's drift hits them alike; prints the median step's tokens/s. Not run
in the test suite: on a shared 2-core CPU the 8192 rows take minutes (docs/benchmarks.md
has the table once the lead runs it on a quiet machine).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_lora import _peak_bytes  # noqa: E402

from jaxtrain.config import apply_overrides, load_config_file  # noqa: E402
from jaxtrain.data.batches import make_batches, to_global  # noqa: E402
from jaxtrain.train.setup import build  # noqa: E402

CONFIG = pathlib.Path(__file__).parents[1] / "configs" / "tiny_qwen3_5.py"
FULL = "full"  # every layer full attention, the same shapes otherwise


def _config(length: int, batch: int, chunk: int | None):
    c = load_config_file(CONFIG)
    overrides = {"model.seq_len": length, "train.global_batch": batch,
                 "data.source": "synthetic", "model.attention": "chunked"}
    if chunk is None:
        overrides["model.layer_types"] = FULL
    else:
        overrides["model.linear_attention.chunk_size"] = chunk
    return apply_overrides(c, overrides)


def _compiled(cfg) -> dict:
    setup = build(cfg, jax.devices()[:1])
    state = setup.init_state()
    tokens = to_global(next(make_batches(cfg).train_iter(0)), setup.tokens_sharding)
    with jax.set_mesh(setup.mesh):
        step = setup.train_step().lower(state, tokens).compile()
        state, metrics = step(state, tokens)  # the first call's allocations
        jax.block_until_ready(metrics)
    return {"step": step, "state": state, "tokens": tokens, "mesh": setup.mesh,
            "peak": _peak_bytes(step), "times": [],
            "tokens_per_step": cfg.train.global_batch * cfg.model.seq_len}


def _time(v: dict) -> None:
    with jax.set_mesh(v["mesh"]):
        start = time.perf_counter()
        v["state"], metrics = v["step"](v["state"], v["tokens"])
        jax.block_until_ready(metrics)
    v["times"].append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--chunks", default="32,64,128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    print("| seq | model | chunk | tokens/s | compiled memory (MB) |\n|---|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        variants = {(FULL, "-"): _compiled(_config(length, args.batch, None))}
        for chunk in chunks:
            variants[("hybrid 3:1", chunk)] = _compiled(_config(length, args.batch, chunk))
        for _ in range(args.rounds):
            for v in variants.values():
                _time(v)
        for (name, chunk), v in variants.items():
            rate = v["tokens_per_step"] / float(np.median(v["times"]))
            print(f"| {length} | {name} | {chunk} | {rate:,.0f} | {v['peak'] / 2**20:,.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
