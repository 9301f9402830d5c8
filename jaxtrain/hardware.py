"""The hardware catalog: jaxtrain/hardware.json plus any user file of the same form.

Each entry gives dense peak FLOP/s per precision, memory size and bandwidth, the one-way
bandwidth per device inside a node and between nodes, power, prices and the source of those
figures. A user file (--hardware-file) adds entries or replaces shipped ones by name.

A low-level module (no jax, nothing of jaxtrain): metrics.py reads peaks from it for MFU and
the planner everything else.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

CATALOG_FILE = pathlib.Path(__file__).with_name("hardware.json")
REQUIRED = ("kind", "flops_tflops", "memory_gb", "memory_bw_gbps", "intra_node_gbps",
            "inter_node_gbps", "devices_per_node", "power_w", "source")
# Dense peak TFLOP/s an entry states (null: unsupported). fp8 is per-tensor-scaled fp8
# (Hopper, Ada, MI300, TPU); mxfp8 the OCP microscaled fp8 with per-32-element scales and
# nvfp4 NVIDIA's 4-bit format with per-16-element scales, both Blackwell's block-scaled
# tensor-core paths: separate columns because a datasheet's "FP8" and "FP4" figures need not
# be what a block-scaled recipe reaches, and pre-Blackwell parts have no such path.
PEAKS = ("fp32", "tf32", "bf16", "fp8", "mxfp8", "nvfp4")
REQUIRED_PEAKS = ("fp32", "tf32", "bf16", "fp8")  # older entries omit mxfp8/nvfp4: null
KINDS = ("gpu", "tpu", "cpu")
# Other names people use for an entry (canonical form: lower case, '-' for '_' and ' ').
ALIASES = {"tpu7x": "TPU-v7", "ironwood": "TPU-v7", "tpu-v7x": "TPU-v7",
           "gb200-nvl72": "GB200", "gb300-nvl72": "GB300"}


class HardwareError(ValueError):
    """An unknown or malformed hardware entry; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    kind: str
    flops_tflops: dict
    memory_gb: float
    memory_bw_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    devices_per_node: int
    power_w: float
    source: str
    purchase_usd: float | None = None
    cloud_usd_per_hour: float | None = None
    devices_per_host: int | None = None  # None: a node is one host (GPUs)
    as_of: str | None = None  # date the figures and prices were read from the sources

    @property
    def host_devices(self) -> int:
        """Devices one host (one process of a job) drives."""
        return self.devices_per_host or self.devices_per_node

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def peak_flops(self, precision) -> float:
        """Dense peak FLOP/s of matmuls for a train.precision entry (precision.py
        PRECISIONS; its `datasheet_peak` names the catalog's figure: fp32, bf16, fp8)."""
        return self.peak_of(precision.datasheet_peak, precision.name)

    def peak_of(self, key: str, precision_name: str = "") -> float:
        """Dense peak FLOP/s of the catalog column `key` (PEAKS)."""
        value = self.flops_tflops.get(key)
        if value is None:
            raise HardwareError(f"--hardware={self.name} is invalid for "
                                f"train.precision={precision_name or key}: it has no {key} "
                                "peak")
        return value * 1e12


def _parse(name: str, entry: dict, origin: str) -> Hardware:
    missing = [k for k in REQUIRED if k not in entry]
    if missing:
        raise HardwareError(f"hardware entry {name!r} in {origin} is invalid: missing "
                            f"{', '.join(missing)}")
    _check_peaks(name, entry["flops_tflops"], origin)
    if entry["kind"] not in KINDS:
        raise HardwareError(f"hardware entry {name!r} in {origin} is invalid: kind="
                            f"{entry['kind']!r}; valid values are {', '.join(KINDS)}")
    for key in ("memory_gb", "memory_bw_gbps", "intra_node_gbps", "inter_node_gbps",
                "devices_per_node", "power_w"):
        if not isinstance(entry[key], (int, float)) or entry[key] <= 0:
            raise HardwareError(f"hardware entry {name!r} in {origin} is invalid: {key}="
                                f"{entry[key]!r}; give a positive number")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    # Every column present (null where the entry does not state it): callers index freely.
    values = {k: v for k, v in entry.items() if k in fields}
    values["flops_tflops"] = {k: entry["flops_tflops"].get(k) for k in PEAKS}
    return Hardware(name=name, **values)


def _check_peaks(name: str, peaks, origin: str) -> None:
    """flops_tflops: the REQUIRED_PEAKS present, only PEAKS keys, each null or > 0."""
    where = f"hardware entry {name!r} in {origin} is invalid"
    if not isinstance(peaks, dict):
        raise HardwareError(f"{where}: flops_tflops must be an object of {', '.join(PEAKS)}")
    unknown = sorted(set(peaks) - set(PEAKS))
    if unknown:
        raise HardwareError(f"{where}: flops_tflops.{unknown[0]} is unknown; valid keys are "
                            f"{', '.join(PEAKS)}")
    missing = [k for k in REQUIRED_PEAKS if k not in peaks]
    if missing:
        raise HardwareError(f"{where}: flops_tflops lacks {', '.join(missing)} (null where "
                            "unsupported)")
    for key, value in peaks.items():
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise HardwareError(f"{where}: flops_tflops.{key}={value!r}; give a positive "
                                "number or null")


def load(extra_file: str | None = None) -> dict[str, Hardware]:
    """The shipped catalog, updated by the entries of extra_file (a JSON object by name)."""
    entries: dict[str, Hardware] = {}
    files = [CATALOG_FILE] + ([pathlib.Path(extra_file)] if extra_file else [])
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise HardwareError(f"--hardware-file={path} is invalid: {e}") from None
        for name, entry in data.items():
            if not name.startswith("_"):
                entries[name] = _parse(name, entry, str(path))
    return entries


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def get(name: str, extra_file: str | None = None) -> Hardware:
    """The entry called name (case, '-' and '_' ignored; a TPU slice name like
    'v5p-128' resolves to its chip)."""
    catalog = load(extra_file)
    wanted = _canonical(ALIASES.get(_canonical(name), name))
    for candidate in (wanted, "tpu-" + wanted.split("-")[0] if wanted.startswith("v") else ""):
        for key, hw in catalog.items():
            if _canonical(key) == candidate:
                return hw
    raise HardwareError(f"--hardware={name} is invalid: valid values are "
                        f"{', '.join(catalog)}")


# jax device_kind prefixes -> catalog entries. Longer prefixes first.
DEVICE_KINDS = (
    ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H100", "H100-SXM"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA A100", "A100-80GB"), ("NVIDIA B200", "B200"), ("NVIDIA B300", "B300"),
    ("NVIDIA GB200", "GB200"), ("NVIDIA GB300", "GB300"), ("TPU v4", "TPU-v4"),
    ("TPU v5 lite", "TPU-v5e"), ("TPU v5", "TPU-v5p"), ("TPU v6 lite", "TPU-v6e"),
)


def for_device_kind(device_kind: str) -> str | None:
    """The catalog entry for a jax device_kind ('NVIDIA H100 80GB HBM3' -> 'H100-SXM')."""
    return next((name for prefix, name in DEVICE_KINDS if device_kind.startswith(prefix)),
                None)


def slice_devices(name: str) -> int | None:
    """Chips (jax devices) in a TPU slice name, else None. v4 and v5p names count
    TensorCores, two per chip (v5p-128 is 64 chips); v5e and v6e names count chips."""
    head, _, tail = _canonical(name).removeprefix("tpu-").partition("-")
    if not (head.startswith("v") and tail.isdigit()):
        return None
    return int(tail) // 2 if head in ("v4", "v5p") else int(tail)
