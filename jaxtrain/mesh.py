"""Device mesh and the logical-axis rules that map array dimensions onto it.

The mesh uses Auto axis types: shardings are stated at the jit boundary (in/out shardings) and
as constraints on activations, and XLA's partitioner propagates the rest. Axis order puts
`tensor` innermost so tensor-parallel collectives stay on the fastest links.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.config import MESH_AXES, ConfigError

Rules = Sequence[tuple[str, "str | tuple[str, ...] | None"]]
LogicalAxes = Sequence["str | None"]


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None,
              dcn: dict[str, int] | None = None) -> Mesh:
    """A mesh of the given total axis sizes. With dcn sizes > 1, a hybrid mesh: each axis is
    dcn × within-granule, granules being TPU slices or else processes (hosts), so that only
    the dcn part of an axis crosses the slow links."""
    shape = tuple(sizes[a] for a in MESH_AXES)
    devices = list(devices if devices is not None else jax.devices())
    if dcn and any(size > 1 for size in dcn.values()):
        return _hybrid_mesh(sizes, dcn, devices)
    if len(devices) == 1 or devices != jax.devices():
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                    axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def _hybrid_mesh(sizes, dcn, devices) -> Mesh:
    from jax.experimental import mesh_utils

    by_slice = len({getattr(d, "slice_index", 0) for d in devices}) > 1  # TPU multislice
    granules = len({d.slice_index if by_slice else d.process_index for d in devices})
    wanted = int(np.prod(list(dcn.values())))
    if granules != wanted:
        unit = "slices" if by_slice else "processes"
        raise ConfigError(f"mesh.dcn_*={wanted} is invalid: the dcn sizes must multiply to "
                          f"the job's {granules} {unit}")
    ici_shape = [sizes[a] // dcn[a] for a in MESH_AXES]
    dcn_shape = [dcn[a] for a in MESH_AXES]
    grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices,
                                                process_is_granule=not by_slice)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def active_rules(rules: Rules, sequence_parallel: bool) -> tuple:
    """The config's rules, less the sequence rule unless sequence parallelism is on."""
    return tuple((name, axes) for name, axes in rules
                 if sequence_parallel or name != "sequence")


def logical_to_spec(axes: LogicalAxes, rules: Rules) -> P:
    used: set[str] = set()
    spec = []
    for name in axes:
        chosen = None
        for rule_name, mesh_axes in rules:
            if rule_name != name or mesh_axes is None:
                continue
            candidate = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
            if not used.intersection(candidate):
                chosen = candidate
                break
        if chosen:
            used.update(chosen)
            spec.append(chosen[0] if len(chosen) == 1 else chosen)
        else:
            spec.append(None)
    return P(*spec)


def named_sharding(mesh: Mesh, axes: LogicalAxes, rules: Rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules))


def constrain(x: jax.Array, axes: LogicalAxes, rules: Rules) -> jax.Array:
    """Pins an activation's sharding; a no-op outside a mesh context (plain eager use)."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, rules))
