"""The planner's memory estimate against XLA's compiled step on real shapes: every shipped
config on its target's device count, and the published runs' layouts (plan/published_runs.json)
with fewer layers so that a CPU compile fits this machine.

    python scripts/memory_check.py [--configs] [--published] [--markdown] [--json FILE]

Each case compiles in a fresh process with N fake CPU devices (plan/compile_check.py) and is
compared with the like-for-like estimate (memory.estimate(backend='cpu'): XLA:CPU keeps
16-bit activations in float32). The estimate must not be more than 15% away and should err
high (ratio ≥ 1). tests/test_plan.py runs a small subset; the full table is in
docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxtrain.config import validate  # noqa: E402
from jaxtrain.plan import memory, published  # noqa: E402
from jaxtrain.plan.compile_check import compile_in_subprocess, load_config, single_granule  # noqa: E402
from jaxtrain.plan.grid import SHIPPED_TARGETS  # noqa: E402

# Published layouts compile on at most this many fake devices (more take minutes each on two
# cores); larger runs keep their axis sizes but fewer data-parallel replicas, and at most
# MAX_LAYERS layers per pipeline stage.
MAX_DEVICES = 64
MAX_LAYERS = 2


def shipped_cases() -> list[dict]:
    return [{"case": name, "config_file": os.path.join(ROOT, "configs", name),
             "overrides": {}, "devices": devices, "hardware": hw}
            for name, (hw, devices) in SHIPPED_TARGETS.items()]


def scaled_run(run: dict, max_devices: int = MAX_DEVICES, cpu: bool = True) -> dict:
    """A published run's layout on ≤ max_devices devices and ≤ MAX_LAYERS layers a stage:
    per-device shapes (sequences, shards) are kept where the axes allow. cpu: replace the
    GPU/TPU attention kernels, which do not compile for CPU."""
    cfg = published.config(run)
    sizes = validate(cfg, run["devices"])
    overrides = dict(run["config"])
    devices = run["devices"]
    # Drop data-parallel replicas, then fsdp, keeping the per-device batch.
    for axis in ("data", "fsdp"):
        while devices > max_devices and sizes[axis] % 2 == 0 and sizes[axis] > 1:
            sizes[axis] //= 2
            devices //= 2
            overrides["train.global_batch"] = overrides["train.global_batch"] // 2
    for axis in ("data", "fsdp", "tensor", "pipeline"):
        overrides[f"mesh.{axis}"] = sizes[axis]
        overrides[f"mesh.dcn_{axis}"] = 1
    if cpu and overrides.get("model.attention") in ("cudnn", "splash", "pallas"):
        # GPU/TPU kernels do not compile for CPU; chunked keeps the same per-query state
        # (a logsumexp, no score matrix), which is what the memory model counts for all three.
        overrides["model.attention"] = "chunked"
    stages = sizes["pipeline"]
    overrides["model.num_layers"] = min(cfg.model.num_layers, MAX_LAYERS * stages)
    return {"case": run["id"], "config_file": f"published:{run['id']}", "overrides": overrides,
            "devices": devices, "hardware": run["hardware"]}


def estimate(case: dict) -> dict:
    """memory.estimate's parts for the case, like for like with a CPU compile."""
    cfg = single_granule(load_config(case["config_file"], case["overrides"]), case["devices"])
    return memory.estimate(cfg, validate(cfg, case["devices"]), backend="cpu")


def compile_case(case: dict) -> dict:
    start = time.perf_counter()
    compiled = compile_in_subprocess(case["config_file"], case["overrides"], case["devices"],
                                     timeout=900)
    return {**compiled, "compile_s": time.perf_counter() - start}


def check(case: dict) -> dict:
    parts = estimate(case)
    est = parts["total"]
    compiled = compile_case(case)
    got = compiled["total_bytes_per_device"]
    return {"case": case["case"], "devices": case["devices"], "estimate_bytes": est,
            "compiled_bytes": got, "ratio": est / got, "compile_s": compiled["compile_s"],
            "estimate_parts": parts,
            **{k: compiled[k] for k in ("argument_bytes", "output_bytes", "alias_bytes",
                                        "temp_bytes")}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", action="store_true", help="only the shipped configs")
    parser.add_argument("--published", action="store_true", help="only the published runs")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args()
    cases = []
    if not args.published:
        cases += shipped_cases()
    if not args.configs:
        cases += [scaled_run(r) for r in published.runs()]
    if args.cases:
        cases = [c for c in cases if c["case"] in args.cases]
    rows = []
    for case in cases:
        try:
            rows.append(check(case))
        except Exception as e:  # noqa: BLE001 - one failing compile is a row too
            rows.append({"case": case["case"], "devices": case["devices"],
                         "error": str(e)[:300]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        print("| case | devices | estimate MiB | XLA compiled MiB | estimate / XLA |")
        print("|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['case']} | {r['devices']} | error: {r['error'][:80]} | | |")
                continue
            print(f"| {r['case']} | {r['devices']} | {r['estimate_bytes'] / 2**20:,.0f} | "
                  f"{r['compiled_bytes'] / 2**20:,.0f} | {r['ratio']:.2f} |")
    bad = [r for r in rows if "error" in r or not 0.85 <= r["ratio"] <= 1.15]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
