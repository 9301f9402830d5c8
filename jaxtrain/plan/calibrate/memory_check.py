"""The planner's memory estimate against XLA's compiled step on real shapes: every shipped
config on its target's device count, the published runs' layouts (plan/published_runs.json)
with fewer layers so that a CPU compile fits this machine, the small test grid
(plan/grid.py), and Llama-3-8B LoRA with its frozen base in each storage kind (--qlora).

    python -m jaxtrain.plan.calibrate.memory_check [--configs] [--published] [--grid]
        [--qlora] [--markdown] [--json FILE] [--update] [CASE ...]

Each case compiles in a fresh process with N fake CPU devices (plan/compile_check.py) and is
compared with the like-for-like estimate (memory.estimate(backend='cpu'): XLA:CPU keeps
16-bit activations in float32). --update stores the compiled figures in
plan/memory_fit.json, which calibrate/fit_memory.py fits the estimate's factors on and
tests/unit/test_plan.py checks every estimate against. Exit code 1 when a case fails to compile,
its estimate is outside memory_fit.TARGET, or its compiled figure moved from the stored one.
CI runs it on the published layouts and the grid (.ci/run; the suite recompiles the configs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxtrain.config import validate
from jaxtrain.plan import memory, memory_fit, published
from jaxtrain.plan.calibrate import ROOT
from jaxtrain.plan.compile_check import compile_in_subprocess
from jaxtrain.plan.grid import GRID, SHIPPED_OVERRIDES, SHIPPED_TARGETS

# Published layouts compile on at most this many fake devices (more take minutes each on two
# cores); larger runs keep their axis sizes but fewer data-parallel replicas, and at most
# MAX_LAYERS layers per pipeline stage.
MAX_DEVICES = 64
MAX_LAYERS = 2


def grid_cases() -> list[dict]:
    return [{"case": f"grid {name}", "config_file": f"grid:{name}", "overrides": {},
             "devices": 8, "hardware": "CPU-host"} for name in GRID]


def shipped_cases() -> list[dict]:
    return [{"case": name, "config_file": f"configs/{name}",
             "overrides": SHIPPED_OVERRIDES.get(name, {}), "devices": devices, "hardware": hw}
            for name, (hw, devices) in SHIPPED_TARGETS.items()]


# Llama-3-8B LoRA on one 24 GB GPU (docs/finetune.md, issue #39): rank 16 on every dense
# projection, seq 2048, batch 1, full remat, the frozen base in each storage kind. One CPU
# device compiles each in 30-45 s on two cores (2026-12-05).
LLAMA_3_8B_LORA = {
    "model.d_model": 4096, "model.num_layers": 32, "model.num_heads": 32,
    "model.num_kv_heads": 8, "model.mlp_dim": 14336, "model.vocab_size": 128256,
    "model.rope_theta": 500000.0, "model.seq_len": 2048, "model.remat": "full",
    "train.global_batch": 1, "mesh.fsdp": 1, "model.lora.rank": 16,
    "model.lora.targets": "q,k,v,o,up,gate,down"}
BASE_DTYPES = ("float32", "bfloat16", "int8", "nf4")


def qlora_cases() -> list[dict]:
    return [{"case": f"llama-3-8b lora base {kind}", "config_file": "configs/llama_1b.py",
             "overrides": {**LLAMA_3_8B_LORA, "model.lora.base_dtype": kind},
             "devices": 1, "hardware": "RTX-4090"} for kind in BASE_DTYPES]


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
    cfg, sizes = memory_fit.config_of(case)
    return memory.estimate(cfg, sizes, backend="cpu")


def compile_case(case: dict) -> dict:
    start = time.perf_counter()
    file = case["config_file"]
    file = os.path.join(ROOT, file) if file.startswith("configs/") else file
    compiled = compile_in_subprocess(file, case["overrides"], case["devices"],
                                     timeout=900)
    return {**compiled, "compile_s": time.perf_counter() - start}


def check(case: dict) -> dict:
    parts = estimate(case)
    est = parts["total"]
    compiled = compile_case(case)
    got = compiled["total_bytes_per_device"]
    return {**{k: case[k] for k in ("case", "config_file", "overrides", "devices")},
            "source": "cpu", "estimate_bytes": est, "compiled_bytes": got,
            "ratio": est / got, "compile_s": compiled["compile_s"], "estimate_parts": parts,
            **{k: compiled[k] for k in ("argument_bytes", "output_bytes", "alias_bytes",
                                        "temp_bytes")}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", action="store_true", help="the shipped configs")
    parser.add_argument("--published", action="store_true", help="the published runs")
    parser.add_argument("--grid", action="store_true", help="the test grid")
    parser.add_argument("--qlora", action="store_true",
                        help="Llama-3-8B LoRA with each frozen-base storage kind")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--update", action="store_true",
                        help="store the compiled figures in plan/memory_fit.json")
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args(argv)
    groups = {"configs": shipped_cases, "published": lambda: [
        scaled_run(r) for r in published.runs()], "grid": grid_cases, "qlora": qlora_cases}
    chosen = [g for g in groups if getattr(args, g)] or list(groups)
    cases = [c for g in chosen for c in groups[g]()]
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
    if args.update:
        memory_fit.store_cases([r for r in rows if "error" not in r])
    if args.markdown:
        print("| case | devices | estimate MiB | XLA compiled MiB | estimate / XLA |")
        print("|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['case']} | {r['devices']} | error: {r['error'][:80]} | | |")
                continue
            print(f"| {r['case']} | {r['devices']} | {r['estimate_bytes'] / 2**20:,.0f} | "
                  f"{r['compiled_bytes'] / 2**20:,.0f} | {r['ratio']:.2f} |")
    sys.exit(1 if problems(rows) else 0)


def problems(rows: list[dict]) -> list[str]:
    """Rows that failed to compile, whose estimate is outside memory_fit.TARGET, or whose
    compiled figure moved from the stored one (plan/memory_fit.json: rerun with --update
    and refit, calibrate/fit_memory.py)."""
    stored = {c["case"]: c for c in memory_fit.cases("cpu", calibrated=False)}
    same = memory_fit.same_compiler()
    if not same:
        print("memory_check: plan/memory_fit.json was compiled with another jax; its figures "
              "are not compared (refresh them with --update)", file=sys.stderr)
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['case']}: {r['error']}")
            continue
        if not memory_fit.within(r["ratio"]) and r["case"] not in memory_fit.UNCALIBRATED:
            low, high = memory_fit.TARGET
            out.append(f"{r['case']}: estimate / XLA {r['ratio']:.3f} outside {low}–{high}")
        old = stored.get(r["case"], {}).get("compiled_bytes")
        if same and old and abs(r["compiled_bytes"] / old - 1) > memory_fit.SAME:
            out.append(f"{r['case']}: compiled {r['compiled_bytes']:,} B, stored {old:,} B")
    for line in out:
        print("memory_check: " + line, file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
