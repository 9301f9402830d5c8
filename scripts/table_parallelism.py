"""Per-strategy numbers for docs/parallelism.md: the pipeline bubble, XLA's compiled memory
per device and the collective bytes per step, for one model on 8 fake CPU devices.

    python scripts/table_parallelism.py [--markdown]

Nothing runs: each layout's train step is only compiled (AOT), and its optimized HLO is read
with jaxtrain.plan.hlo.collective_bytes.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402

from jaxtrain.config import base_config  # noqa: E402
from jaxtrain.plan.compile_check import compile_step, memory_figures  # noqa: E402
from jaxtrain.plan.hlo import collective_bytes  # noqa: E402
from jaxtrain.train.setup import build  # noqa: E402

STRATEGIES = {
    "data=8": dict(data=8),
    "fsdp=8": dict(fsdp=8),
    "tensor=8": dict(tensor=8),
    "tensor=8 + sequence parallel": dict(tensor=8, sequence_parallel=True),
    "data=2 fsdp=2 tensor=2": dict(data=2, fsdp=2, tensor=2),
    "pipeline=4 data=2, gpipe m=8": dict(pipeline=4, data=2),
    "pipeline=4 data=2, circular v=2 m=8": dict(pipeline=4, data=2, schedule="circular"),
}


def model_config():
    c = base_config()
    c.model.family = "gpt2"
    c.model.d_model = 256
    c.model.num_layers = 8
    c.model.num_heads = 8
    c.model.mlp_dim = 1024
    c.model.vocab_size = 4096
    c.model.seq_len = 256
    c.train.global_batch = 32
    c.pipeline.microbatches = 8
    c.mesh.data = 1
    return c


def measure(name: str, layout: dict) -> dict:
    cfg = model_config()
    layout = dict(layout)
    if layout.pop("schedule", None) == "circular":
        cfg.pipeline.schedule, cfg.pipeline.repeats = "circular", 2
    for key, value in layout.items():
        cfg.mesh[key] = value
    setup = build(cfg)
    compiled = compile_step(setup)
    memory = memory_figures(compiled)
    traffic = collective_bytes(compiled.as_text())
    pipe = setup.spec.pipeline
    return {"strategy": name, "bubble": pipe.bubble if pipe else 0.0,
            "memory_argument_bytes": memory["argument_bytes"],
            "memory_temp_bytes": memory["temp_bytes"],
            **{f"{kind}_bytes": value for kind, value in traffic.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = [measure(name, layout) for name, layout in STRATEGIES.items()]
    if not args.markdown:
        for row in rows:
            print(json.dumps(row))
        return
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print("| strategy | bubble | state+args MiB | temporaries MiB | all-reduce MiB | "
          "all-gather MiB | reduce-scatter MiB | permute MiB | all-to-all MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['bubble']:.1%} | {mib(r['memory_argument_bytes'])} | "
              f"{mib(r['memory_temp_bytes'])} | {mib(r['all-reduce_bytes'])} | "
              f"{mib(r['all-gather_bytes'])} | {mib(r['reduce-scatter_bytes'])} | "
              f"{mib(r['collective-permute_bytes'])} | {mib(r['all-to-all_bytes'])} |")


if __name__ == "__main__":
    main()
