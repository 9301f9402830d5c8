"""The time model's fitted parameters per hardware family, and how far to trust them.

plan/calibration.json is written by plan/calibrate/fit_planner.py, which fits the parameters
on the published training runs of plan/published_runs.json (plan/published.py) and records,
per family, how many runs it saw and the largest in-sample and leave-one-out errors of the
predicted MFU. Hardware without published runs gets the `default` parameters and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

CALIBRATION_FILE = pathlib.Path(__file__).with_name("calibration.json")
# The parameters of step_time (plan/timing.py), in the order the fit uses.
FAMILY_PARAMS = ("matmul_efficiency",)
SHARED_PARAMS = ("width_knee", "attention_speed", "intra_link_efficiency",
                 "inter_link_efficiency", "collective_latency_s", "overlap", "tensor_overlap",
                 "low_precision_efficiency")


@dataclasses.dataclass(frozen=True)
class Calibration:
    family: str
    matmul_efficiency: float  # fraction of the dense peak that very wide matmuls reach
    width_knee: float  # d_model at which the matmul efficiency is half of that
    attention_speed: float  # attention FLOPs' speed relative to the weight matmuls'
    intra_link_efficiency: float  # of the datasheet in-node link bandwidth
    inter_link_efficiency: float  # of the datasheet inter-node bandwidth
    collective_latency_s: float  # per collective
    overlap: float  # of data/fsdp collectives hidden under compute
    tensor_overlap: float  # of tensor/pipeline collectives hidden under compute
    low_precision_efficiency: float  # fp8 matmuls' fraction of peak over the bf16 ones'
    runs: int = 0  # published runs of this family it was fitted on
    max_error: float | None = None  # largest |predicted/published − 1| of MFU among them
    loo_max_error: float | None = None  # the same, each run predicted by a fit without it
    calibrated: bool = True

    def describe(self) -> str:
        """The uncertainty statement printed with every plan."""
        if not self.calibrated or not self.runs:
            return (f"uncalibrated for this hardware: {self.family} parameters, fitted on "
                    "other hardware; error unknown")
        return (f"±{self.max_error:.0%} on {self.runs} published runs of the {self.family} "
                f"family (±{self.loo_max_error:.0%} leave-one-out)")

    def overlap_text(self) -> str:
        return (f"matmuls at {self.matmul_efficiency:.0%} of peak × d/(d+{self.width_knee:.0f});"
                f" {self.overlap:.0%} of data/fsdp and {self.tensor_overlap:.0%} of "
                "tensor/pipeline collectives overlap with compute")


@functools.cache
def _load(path: str) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def from_params(family: str, params: dict, **stats) -> Calibration:
    return Calibration(family=family, **{k: params[k] for k in FAMILY_PARAMS + SHARED_PARAMS},
                       **stats)


def for_family(family: str, path: str | None = None) -> Calibration:
    data = _load(str(path or CALIBRATION_FILE))
    entry = data["families"].get(family)
    shared = data["shared"]
    if entry is None:
        default = data["families"][data["default_family"]]
        return from_params(data["default_family"], {**shared, **default["params"]},
                           calibrated=False)
    return from_params(family, {**shared, **entry["params"]}, runs=entry["runs"],
                       max_error=entry["max_error"], loo_max_error=entry["loo_max_error"])


def family_of(hardware_name: str, path: str | None = None) -> str | None:
    data = _load(str(path or CALIBRATION_FILE))
    return next((f for f, e in data["families"].items() if hardware_name in e["hardware"]),
                None)


def for_hardware(hardware_name: str, path: str | None = None) -> Calibration:
    """The calibration of the family a catalog entry belongs to; else its nearest fitted
    family's (calibration.json `nearest`: TPU7x borrows v5p's, a TPU with the same ICI),
    else the default's, either marked uncalibrated."""
    family = family_of(hardware_name, path)
    if family is not None:
        return for_family(family, path)
    data = _load(str(path or CALIBRATION_FILE))
    nearest = data.get("nearest", {}).get(hardware_name)
    if nearest in data["families"]:
        return dataclasses.replace(for_family(nearest, path), runs=0, max_error=None,
                                   loo_max_error=None, calibrated=False)
    return for_family("", path)
