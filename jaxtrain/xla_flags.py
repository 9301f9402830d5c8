"""XLA_FLAGS for fake CPU devices: the host platform's device count set, every other flag
the user gave kept (a dump directory, a debug option), for this process before jax starts
its backend or for a child process (ranks, compile checks)."""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def with_device_count(devices: int, flags: str | None = None) -> str:
    """`flags` (default: this process's XLA_FLAGS) with the device count set to `devices`."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    kept = [f for f in flags.split() if not f.startswith(DEVICE_COUNT)]
    return " ".join([*kept, f"{DEVICE_COUNT}={devices}"])
