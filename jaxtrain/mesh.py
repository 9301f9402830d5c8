"""Device mesh: its axes (one registry entry each), their sizes, and the logical-axis rules
that map array dimensions onto them.

The mesh uses Auto axis types: shardings are stated at the jit boundary (in/out shardings) and
as constraints on activations, and XLA's partitioner propagates the rest. Axis order puts
`tensor` innermost so tensor-parallel collectives stay on the fastest links.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import ConfigError, fail

Rules = Sequence[tuple[str, "str | tuple[str, ...] | None"]]
LogicalAxes = Sequence["str | None"]

# Logical axis -> mesh axes. For each logical dimension of an array the first rule whose mesh
# axes are not already used by an earlier dimension of the same array applies; a dimension
# with no usable rule is replicated. That is how 'embed' is fsdp-sharded in a weight but
# replicated in an activation whose 'batch' already took fsdp.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    # Parameters are sharded over fsdp and, under context parallelism, over context too:
    # the devices of a context group hold different positions of the same rows, so to the
    # weights they are data-parallel ranks, and ZeRO-3 over them divides the model state
    # by C (as MaxText's rules and torchtitan's FSDP over dp_shard×cp do). Activations never
    # take it: their batch dimension has already used fsdp.
    ("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    # The residual stream's length between blocks: over context (context parallelism) and,
    # only when mesh.sequence_parallel, tensor (active_rules drops what is off).
    ("sequence", ("context", "tensor")),
    # Every other per-position activation's length (attention's q/k/v, the MLP, logits):
    # split over context only (parallel/context.py).
    ("length", "context"),
    # The stacked layers of the model, and the stage axis of the pipeline's buffers.
    ("layers", "pipeline"),
    ("stage", "pipeline"),
    # The experts of an MoE layer (models/moe.py).
    ("experts", "expert"),
    # The rank of a LoRA adapter (models/lora.py): small, never split.
    ("lora", None),
)


def _check_fsdp(c, size: int) -> None:
    if c.model.d_model % size:
        fail("model.d_model", c.model.d_model, f"must be divisible by mesh.fsdp={size}")


def _check_tensor(c, size: int) -> None:
    m = c.model
    for key, value in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads or m.num_heads),
                       ("mlp_dim", m.mlp_dim), ("vocab_size", m.vocab_size)):
        if value % size:
            fail(f"model.{key}", value, f"must be divisible by mesh.tensor={size}")
    if c.mesh.sequence_parallel and m.seq_len % size:
        fail("model.seq_len", m.seq_len, f"must be divisible by mesh.tensor={size} under "
             "mesh.sequence_parallel")


def _check_expert(c, size: int) -> None:
    experts = c.model.moe.num_experts
    if size > 1 and not experts:
        fail("mesh.expert", size, "shards the experts of an MoE model (model.moe.num_experts "
             "is 0); use mesh.data to split the batch of a dense model")
    if experts % size:
        fail("model.moe.num_experts", experts, f"must be divisible by mesh.expert={size}")


def _check_context(c, size: int) -> None:
    """Context parallelism (parallel/context.py): the sequence splits into C (2C balanced)
    equal runs. What runs under it is each registry entry's own check (config.validate)."""
    if size == 1:
        return
    m, runs = c.model, size * (2 if c.mesh.context_load_balance else 1)
    if m.seq_len % runs:
        how = f"2×mesh.context={runs} chunks (mesh.context_load_balance)" \
            if c.mesh.context_load_balance else f"mesh.context={size}"
        fail("model.seq_len", m.seq_len, f"must divide into {how}")
    tensor = c.mesh.tensor * c.mesh.dcn_tensor
    if c.mesh.sequence_parallel and tensor > 0 and m.seq_len % (size * tensor):
        fail("model.seq_len", m.seq_len, f"must be divisible by mesh.context×mesh.tensor="
             f"{size * tensor} under mesh.sequence_parallel")


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One mesh axis: `mesh.NAME` and `mesh.dcn_NAME` in the config, and its checks."""

    name: str
    doc: str
    check: Callable | None = None  # (config, total size) -> None, raising ConfigError
    batch: bool = False  # splits the global batch (each shard a different slice of rows)
    dcn: str | None = None  # why this axis must stay within a node; None: it may span nodes

    def validate(self, c, size: int) -> None:
        if self.check is not None:
            self.check(c, size)


# In mesh order, outermost first: the innermost axis gets the fastest links.
AXES: dict[str, MeshAxis] = {a.name: a for a in (
    MeshAxis("data", "replicas of the model, each on a slice of the batch", batch=True),
    MeshAxis("pipeline", "consecutive layers per stage, micro-batches flowing through "
             "(what it must divide: the schedule's check, parallel/pipeline.py SCHEDULES)"),
    MeshAxis("fsdp", "parameters, gradients and optimizer state sharded (ZeRO-3), batch "
             "split", _check_fsdp, batch=True),
    MeshAxis("expert", "MoE experts sharded, tokens exchanged by all-to-all; the batch "
             "split for the dense parts", _check_expert, batch=True),
    MeshAxis("context", "the sequence split (context parallelism): activations sharded "
             "along it, attention by all-gathered or ring-passed K/V; parameters sharded "
             "over it as over fsdp", _check_context),
    MeshAxis("tensor", "Megatron-style tensor parallelism over heads, MLP and vocab",
             _check_tensor, dcn="tensor parallelism needs fast links: keep it within a node "
             "(mesh.tensor) and put data, fsdp or pipeline across nodes"),
)}
MESH_AXES = tuple(AXES)


def defaults() -> dict:
    """The `mesh` section of config.base_config()."""
    return {
        # mesh.NAME: size within a node or slice; -1: the rest of the devices
        **{axis: -1 if axis == "data" else 1 for axis in AXES},
        "sequence_parallel": False,
        # mesh.context > 1: each device holds 2 chunks of the row, i and 2C-1-i, so that causal
        # attention work is equal on every device (parallel/context.py); False: a plain split.
        "context_load_balance": True,
        # Sizes across the slow links between hosts/slices (DCN); the plain sizes are within one.
        **{f"dcn_{axis}": 1 for axis in AXES},
        "rules": DEFAULT_RULES,
    }


def dcn_shape(mesh_cfg) -> dict[str, int]:
    """Per-axis sizes across the slow links (between hosts or slices); 1 where unused."""
    return {axis: int(mesh_cfg[f"dcn_{axis}"]) for axis in MESH_AXES}


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    """Total mesh axis sizes (within-node size × dcn size), the one -1 filled so that they
    multiply to num_devices."""
    dcn = dcn_shape(mesh_cfg)
    for axis, size in dcn.items():
        if size < 1:
            fail(f"mesh.dcn_{axis}", size, "must be >= 1")
        if size != 1 and AXES[axis].dcn is not None:
            fail(f"mesh.dcn_{axis}", size, AXES[axis].dcn)
    granules = math.prod(dcn.values())
    if num_devices % granules:
        fail("mesh", f"dcn sizes multiplying to {granules}", f"must divide the {num_devices} "
             "devices")
    per_granule = num_devices // granules
    sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            fail(f"mesh.{axis}", size, "a positive size, or -1 for 'the rest'")
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        fail(f"mesh.{free[1]}", -1, f"only one axis may be -1 (mesh.{free[0]} already is)")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    where = f"the {per_granule} devices of each of the {granules} dcn groups" if granules > 1 \
        else f"the {num_devices} devices"
    if free:
        if per_granule % fixed:
            fail(f"mesh.{free[0]}", -1, f"the other axes multiply to {fixed}, "
                 f"which does not divide {where}")
        sizes[free[0]] = per_granule // fixed
    elif fixed != per_granule:
        shown = "×".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "1"
        fail("mesh", shown, f"the mesh axes must multiply to {where} "
             f"(got {fixed}); set one axis to -1 to fill the rest")
    return {axis: sizes[axis] * dcn[axis] for axis in MESH_AXES}


def validate_axes(c, sizes: dict[str, int]) -> None:
    """Each axis's own checks (what the model and schedule need to split over it)."""
    for axis, entry in AXES.items():
        entry.validate(c, sizes[axis])
    zero = sizes["fsdp"] * sizes["context"]
    if sizes["context"] > 1 and c.model.d_model % zero:
        fail("model.d_model", c.model.d_model, f"must be divisible by mesh.fsdp×mesh.context="
             f"{zero} (the parameters are sharded over both)")


def batch_shards(sizes: dict[str, int]) -> int:
    """Ways the batch is split across the mesh (the product of the batch axes)."""
    return math.prod(sizes[a] for a, entry in AXES.items() if entry.batch)


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


def active_rules(rules: Rules, sequence_parallel: bool, context: bool = False) -> tuple:
    """The config's rules, less `tensor` in the sequence rules unless sequence parallelism
    is on, and less `context` everywhere unless context parallelism is (so that without it
    every spec is what it was before the axis existed); rules left empty are dropped."""
    out = []
    for name, axes in rules:
        kept = (axes,) if isinstance(axes, str) else tuple(axes or ())
        kept = tuple(a for a in kept if (context or a != "context")
                     and (sequence_parallel or name != "sequence" or a != "tensor"))
        if kept or axes is None:
            out.append((name, kept[0] if len(kept) == 1 else (kept or None)))
    return tuple(out)


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
