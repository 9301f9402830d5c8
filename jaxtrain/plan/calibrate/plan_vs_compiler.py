"""The planner's memory estimate against XLA's compiled per-device memory, on the grid of
small models and meshes that tests/unit/test_plan.py checks (8 fake CPU devices).

    python -m jaxtrain.plan.calibrate.plan_vs_compiler [--markdown] [CASE ...]

Nothing runs: each case's train step is only compiled (AOT).
"""

from __future__ import annotations

import argparse
import json
import os


def compare(name: str):
    from jaxtrain.config import validate
    from jaxtrain.plan import memory
    from jaxtrain.plan.compile_check import compiled_memory
    from jaxtrain.plan.grid import grid_config

    cfg = grid_config(name)
    sizes = validate(cfg, 8)
    est = memory.estimate(cfg, sizes, backend="cpu")  # like for like with a CPU compile
    got = compiled_memory(cfg)
    return {"case": name, "estimate_bytes": est["total"],
            "compiled_bytes": got["total_bytes_per_device"],
            "ratio": est["total"] / got["total_bytes_per_device"], "parts": est,
            "compiled": got}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args(argv)
    # The grid's 8 fake CPU devices, set before jax loads (the imports below load it).
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxtrain.plan.grid import GRID

    rows = [compare(name) for name in (args.cases or GRID)]
    if not args.markdown:
        for r in rows:
            print(json.dumps({k: r[k] for k in ("case", "estimate_bytes", "compiled_bytes",
                                                "ratio")}
                             | {"temp": r["compiled"]["temp_bytes"],
                                "args": r["compiled"]["argument_bytes"],
                                **{k: round(v / 2**20, 2) for k, v in r["parts"].items()}}))
        return
    print("| case | estimate MiB | XLA compiled MiB | estimate / XLA |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['estimate_bytes'] / 2**20:.1f} | "
              f"{r['compiled_bytes'] / 2**20:.1f} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
