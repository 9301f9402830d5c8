"""XLA's own figure: AOT-compile the real train step for a mesh and read its memory.

Nothing is allocated or run: the state and the batch are ShapeDtypeStructs with shardings,
so a 13B model on 64 fake CPU devices compiles in seconds on a laptop. Fake devices must be
requested before jax is imported (XLA_FLAGS=--xla_force_host_platform_device_count=N), so
for a device count other than the current process's this runs itself in a subprocess:

    python -m jaxtrain.plan.compile_check --devices N --config FILE [KEY=VALUE ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import ml_collections

from jaxtrain.config import MESH_AXES, apply_overrides, load_config_file, resolve_mesh_shape
from jaxtrain.plan import published
from jaxtrain.plan.grid import grid_config
from jaxtrain.plan.hlo import collective_bytes
from jaxtrain.train.setup import build
from jaxtrain.xla_flags import with_device_count


def compile_step(setup, state=None, tokens=None):
    """The setup's train step, lowered and compiled for its mesh. state and tokens default to
    abstract ones (ShapeDtypeStructs with shardings: nothing is allocated)."""
    if tokens is None:
        tokens = setup.abstract_batch()
    if state is None:
        # Outside set_mesh: with compile-only (TPU topology) devices, the eager random key
        # inside abstract_state would otherwise be dispatched to them and fail.
        state = setup.abstract_step_state()
    with jax.set_mesh(setup.mesh):
        on_cpu = setup.mesh.devices.flat[0].platform == "cpu"
        return setup.train_step().lower(state, tokens).compile(
            CPU_FIGURES_OPTIONS if on_cpu else None)


# plan/memory_fit.json holds XLA:CPU's figures with its default fusion emitters. The older
# elemental emitters (XLA_FLAGS=--xla_cpu_use_fusion_emitters=false, which the test suite
# sets: they compile several times faster) fuse differently and move a step's temporaries
# by up to 8% (gpt13b_pp: 34.5 GB against 37.6 GB), so the planner's compiles name the
# emitters themselves rather than take the caller's.
CPU_FIGURES_OPTIONS = {"xla_cpu_use_fusion_emitters": True}


def memory_figures(compiled) -> dict:
    """Per-device bytes of a compiled step: arguments, outputs, aliased, temporaries and
    'total_bytes_per_device' (what must fit: arguments + outputs − aliased + temporaries)."""
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
            "total_bytes_per_device": total}


def compiled_memory(cfg, devices=None) -> dict:
    """memory_figures of cfg's step on `devices` (default: all), with the collective bytes
    of its HLO (plan/hlo.py), the device count and platform."""
    cfg = single_granule(cfg, len(devices) if devices else None)
    setup = build(cfg, devices)
    compiled = compile_step(setup)
    return {**memory_figures(compiled), "devices": len(setup.mesh.devices.flat),
            "platform": setup.mesh.devices.flat[0].platform,
            "collective_bytes": collective_bytes(compiled.as_text())}


def single_granule(cfg, devices: int | None = None):
    """Multi-host dcn sizes folded into the plain axis sizes: one process of fake devices
    has no hosts to split by, and per-device memory depends only on the axis sizes."""
    if all(cfg.mesh[f"dcn_{a}"] == 1 for a in MESH_AXES):
        return cfg
    sizes = resolve_mesh_shape(cfg.mesh, devices or jax.device_count())
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    for axis in MESH_AXES:
        cfg.mesh[axis], cfg.mesh[f"dcn_{axis}"] = sizes[axis], 1
    return cfg


def compile_in_subprocess(config_file: str, overrides: dict, devices: int,
                          timeout: float = 600) -> dict:
    """compiled_memory on `devices` fake CPU devices, in a fresh Python process.
    config_file: a path, or 'published:RUN_ID' (load_config)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=with_device_count(devices))
    argv = [sys.executable, "-m", "jaxtrain.plan.compile_check", "--devices", str(devices),
            "--config", config_file] + [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"compile check failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_config(config_file: str, overrides: dict):
    """A config file's get_config() (or, for 'published:RUN_ID', a published run's config,
    plan/published.py; for 'grid:NAME', a case of the planner's test grid, plan/grid.py)
    with dotted KEY=VALUE overrides applied."""
    if config_file.startswith("published:"):
        run_id = config_file.removeprefix("published:")
        cfg = published.config(next(r for r in published.runs() if r["id"] == run_id))
    elif config_file.startswith("grid:"):
        cfg = grid_config(config_file.removeprefix("grid:"))
    else:
        cfg = load_config_file(config_file)
    return apply_overrides(cfg, overrides)


def _main(argv) -> None:
    devices = int(argv[argv.index("--devices") + 1])
    config_file = argv[argv.index("--config") + 1]
    overrides = dict(a.split("=", 1) for a in argv[argv.index("--config") + 2:])
    overrides = {k: json.loads(v) for k, v in overrides.items()}
    # Read when the CPU backend starts (the first jax.devices()), not at import.
    os.environ["XLA_FLAGS"] = with_device_count(devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    result = compiled_memory(load_config(config_file, overrides), jax.devices()[:devices])
    print(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1:])
