"""The compiled steps the memory estimate is fitted on and checked against.

plan/memory_fit.json holds, besides the fitted Factors (memory.py), one row per compiled
case: where it was compiled ('cpu': XLA:CPU on fake devices, scripts/memory_check.py;
'tpu': libtpu's AOT compile for a TPU topology, scripts/tpu_aot_check.py --plan), the config
and device count it was compiled for, and XLA's per-device bytes. The estimate for a row is
like for like: on CPU rows float32 activations (XLA:CPU keeps 16-bit ones in float32) and
the CPU factors, on TPU rows the compute dtype and the TPU factors. tests/test_plan.py holds
every row within 15%; the scripts recompile them (CI runs the CPU set).
"""

from __future__ import annotations

import json
import os

from jaxtrain.config import validate
from jaxtrain.plan import memory
from jaxtrain.plan.compile_check import load_config, single_granule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What tests/test_plan.py and scripts/memory_check.py hold every row's estimate / XLA to:
# never more than 15% low; up to 30% high while issue 19's ±15% is not met on every row
# (docs/planner.md names the rows outside it).
HELD = (0.85, 1.30)
# A stored compiled figure is current when a recompile lands within this of it.
SAME = 0.02
KEPT = ("case", "source", "config_file", "overrides", "devices", "compiled_bytes",
        "argument_bytes", "temp_bytes")


def load() -> dict:
    with open(memory.FIT_FILE) as f:
        return json.load(f)


def cases(source: str | None = None) -> list[dict]:
    """The stored rows, of one source or all."""
    return [c for c in load().get("cases", []) if source in (None, c["source"])]


def store_cases(rows: list[dict]) -> None:
    """Rows (with the KEPT keys) replace the stored rows of the same source and case."""
    data = load()
    fresh = {(r["source"], r["case"]): {k: r[k] for k in KEPT} for r in rows}
    kept = [c for c in data.get("cases", []) if (c["source"], c["case"]) not in fresh]
    data["cases"] = sorted(kept + list(fresh.values()),
                           key=lambda c: (c["source"], c["case"]))
    write(data)


def write(data: dict) -> None:
    with open(memory.FIT_FILE, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def config_of(case: dict):
    """(config, mesh sizes) a stored row was compiled for."""
    file = case["config_file"]
    if file.startswith("configs/"):  # the repository's configs, wherever this runs from
        file = os.path.join(ROOT, file)
    cfg = single_granule(load_config(file, case["overrides"]), case["devices"])
    return cfg, validate(cfg, case["devices"])


def estimate(case: dict, factors: memory.Factors | None = None, config=None) -> float:
    """The like-for-like estimate of a stored row, bytes per device. config: config_of's
    result, to skip rebuilding it (the fit evaluates each row many times)."""
    cfg, sizes = config or config_of(case)
    backend = "cpu" if case["source"] == "cpu" else "accelerator"
    return memory.estimate(cfg, sizes, backend=backend, platform=case["source"],
                           factors=factors)["total"]
