"""python -m jaxtrain.plan --config configs/NAME.py --hardware NAME --devices N
       [--tokens T | --hours H] [--price-per-hour P] [--json] [--search [--by cost]]
       [--compile] [--config.KEY=VALUE ...]"""

from __future__ import annotations

import os
import sys


def _fake_devices_before_jax(argv: list[str]) -> None:
    """--compile needs N fake CPU devices, which XLA reads once, when jax is imported."""
    if "--compile" not in argv:
        return
    devices = None
    for i, arg in enumerate(argv):
        if arg.startswith("--devices="):
            devices = arg.split("=", 1)[1]
        elif arg == "--devices" and i + 1 < len(argv):
            devices = argv[i + 1]
        elif arg.startswith("--hardware") and devices is None:
            from jaxtrain.plan.catalog import slice_devices
            name = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            devices = slice_devices(name)
    if devices:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(
            flags + [f"--xla_force_host_platform_device_count={devices}"])
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
    _fake_devices_before_jax(sys.argv[1:])
    from absl import app

    from jaxtrain.cli import parse_flags
    from jaxtrain.plan.cli import main

    app.run(main, flags_parser=parse_flags)
