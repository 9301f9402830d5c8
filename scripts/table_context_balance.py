"""Per-device attention work of a context-parallel train step, counted as it runs.

    python scripts/table_context_balance.py [--seq 32768] [--context 8] [--window 0] [--plain]

Runs one train step of a narrow llama (the layout of configs/llama_1b_32k.py: GQA 32/8
heads of 64 dims, context=8, zig-zag unless --plain; 64 wide, one layer, so that a CPU runs
it in seconds) on fake CPU devices with a work counter in its ContextSpec (count_work): every
(query tile, key tile) pair the compiled kernel computes reports its FLOPs, forward and
backward, from the device that computed it. Prints each device's FLOPs, max/min and
max/mean (docs/benchmarks.md), and checks them against computed_scores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="no zig-zag load balance")
    args = parser.parse_args()
    from jaxtrain.xla_flags import with_device_count

    os.environ["XLA_FLAGS"] = with_device_count(args.context)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    from jaxtrain.config import apply_overrides, base_config
    from jaxtrain.data.batches import make_batches, to_global
    from jaxtrain.models.attention import computed_scores
    from jaxtrain.parallel.context import ContextSpec
    from jaxtrain.train.setup import build
    from jaxtrain.train.state import abstract_model

    cfg = base_config()
    cfg.model.update(family="llama", d_model=64, num_layers=1, num_heads=32, num_kv_heads=8,
                     head_dim=64, mlp_dim=128, vocab_size=256, seq_len=args.seq,
                     sliding_window=args.window)
    cfg = apply_overrides(cfg, {"mesh.data": 1, "mesh.context": args.context,
                                "mesh.context_load_balance": not args.plain,
                                "train.global_batch": 1, "data.source": "synthetic"})
    work = np.zeros(args.context)

    def count(device, flops):
        work[int(device)] += int(flops)

    setup = build(cfg, jax.devices()[:args.context])
    # The counter travels in the spec, and the model (its graphdef) is rebuilt from it.
    spec = dataclasses.replace(setup.spec, context=dataclasses.replace(setup.spec.context,
                                                                       count_work=count))
    setup = dataclasses.replace(setup, spec=spec, graphdef=nnx.graphdef(abstract_model(spec)))
    state = setup.init_state()
    batch = next(make_batches(cfg).train_iter(0))
    with jax.set_mesh(setup.mesh):
        state, metrics = setup.train_step()(state, to_global(batch, setup.tokens_sharding))
        jax.block_until_ready(metrics)
    spec = ContextSpec(args.context, setup.spec.context.variant, not args.plain)
    # Per score of a row and query head: 2·64 FLOPs per matmul, 2 forward and 5 backward.
    predicted = computed_scores(spec, args.seq, args.window or None) \
        * 32 * 2 * 64 * 7
    print(json.dumps({"seq": args.seq, "context": args.context, "window": args.window,
                      "zigzag": not args.plain, "variant": spec.variant,
                      "tflops_per_device": [round(w / 1e12, 4) for w in work],
                      "max_over_min": round(work.max() / work.min(), 4),
                      "max_over_mean": round(work.max() / work.mean(), 4),
                      "as_predicted": bool((work == predicted).all())}))


if __name__ == "__main__":
    main()
