"""Train state and its shardings; parameters are born sharded."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct, traverse_util
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.mesh import named_sharding
from jaxtrain.models import ModelSpec, Transformer, base_storage, lora

# Folded into the seed's key for the adapters' draws, which then differ from the base's.
ADAPTER_KEY = 0x10CA


@struct.dataclass
class LossScale:
    """Dynamic loss scaling for float16 compute (as torch's GradScaler): the loss is
    multiplied by `scale` before differentiation; an overflow halves it (and the step is
    skipped), `period` good steps in a row double it."""

    scale: jax.Array  # float32
    good_steps: jax.Array  # int32, finite steps since the last change

    def update(self, finite: jax.Array, period: int) -> LossScale:
        good = jnp.where(finite, self.good_steps + 1, 0)
        grow = good >= period
        scale = jnp.where(finite, jnp.where(grow, self.scale * 2, self.scale), self.scale / 2)
        return LossScale(scale=scale, good_steps=jnp.where(grow, 0, good))


# The frozen models a state may hold, by role: LoRA's base (the model the adapters are joined
# to) and a reference model's parameters (DPO without LoRA: a copy of the starting ones).
# train/frozen.py ROLES loads each.
BASE, REFERENCE = "base", "reference"


@struct.dataclass
class Frozen:
    """A frozen model the step reads and never changes: its parameters (no gradient, no
    optimizer state; loaded again by every run, fresh or resumed, never checkpointed;
    None in a state just restored) and its fingerprint (uint32[8], train/frozen.py), which
    a checkpoint holds as `<role>_fingerprint` so that a resume refuses another."""

    params: dict | None
    fingerprint: jax.Array | None


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict  # the trained nnx.Param values (pure nested dict); LoRA: the adapters
    opt_state: Any
    loss_scale: LossScale | None = None  # float16 precision only
    # role -> Frozen (BASE, REFERENCE): one mapping for every frozen model, so that a new
    # one is a role of train/frozen.py, not two more fields here.
    frozen: dict = struct.field(default_factory=dict)

    def tree(self) -> dict:
        """The checkpointed tree: absent fields (loss_scale outside float16) are left out,
        since orbax cannot restore into a None; of a frozen model only its fingerprint, at
        the key it has had since before the mapping (`base_fingerprint`,
        `reference_fingerprint`), so that checkpoints read both ways."""
        tree = {"step": self.step, "params": self.params, "opt_state": self.opt_state}
        if self.loss_scale is not None:
            tree["loss_scale"] = self.loss_scale
        for role, frozen in self.frozen.items():
            tree[f"{role}_fingerprint"] = frozen.fingerprint
        return tree

    @classmethod
    def from_tree(cls, tree: dict) -> TrainState:
        """The state of a checkpointed tree: its frozen models' fingerprints, their
        parameters still to load (train/frozen.py attach)."""
        tree = dict(tree)
        frozen = {key.removesuffix("_fingerprint"): Frozen(None, tree.pop(key))
                  for key in [k for k in tree if k.endswith("_fingerprint")]}
        return cls(**tree, frozen=frozen)

    def frozen_params(self, role: str) -> dict | None:
        """The parameters of the frozen model of this role; None without one."""
        frozen = self.frozen.get(role)
        return None if frozen is None else frozen.params

    def without_frozen_params(self) -> TrainState:
        """The state less its frozen models' parameters (what a checkpoint restores)."""
        return self.replace(frozen={role: f.replace(params=None)
                                    for role, f in self.frozen.items()})

    def model_params(self) -> dict:
        """Every parameter of the model (what nnx.merge with the run's graphdef takes)."""
        base = self.frozen_params(BASE)
        return self.params if base is None else lora.join(base, self.params)

    def reference_params(self) -> dict | None:
        """The frozen parameters a reference model runs on (objectives.py): DPO's copy,
        else LoRA's base (the model without adapters); None without either."""
        reference = self.frozen_params(REFERENCE)
        return self.frozen_params(BASE) if reference is None else reference


def abstract_model(spec: ModelSpec) -> Transformer:
    return nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0)))


def param_axes(model: Transformer) -> dict:
    """{path tuple: logical axes} of every parameter, from its nnx.Param metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {tuple(k.key for k in path): var.get_metadata()["axes"] for path, var in leaves}


def param_shardings(model: Transformer, mesh: Mesh, rules) -> dict:
    """NamedSharding per parameter, from the logical axes each nnx.Param carries."""
    return traverse_util.unflatten_dict({
        path: named_sharding(mesh, axes, rules) for path, axes in param_axes(model).items()})


def _create_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
                  loss_scale: float | None, key: jax.Array) -> TrainState:
    """The trained part of a fresh state; under LoRA the adapters alone (drawn from a key
    of their own), the frozen base being loaded apart (train/frozen.py)."""
    if spec.lora is not None:
        key = jax.random.fold_in(key, ADAPTER_KEY)
    params = nnx.to_pure_dict(nnx.state(Transformer(spec, rngs=nnx.Rngs(key)), nnx.Param))
    if spec.lora is not None:  # XLA drops the base weights drawn here: only adapters leave
        params = lora.split(params)[0]
    scale = None if loss_scale is None else LossScale(
        scale=jnp.asarray(loss_scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), loss_scale=scale)


def create_base(spec: ModelSpec, key: jax.Array) -> dict:
    """The parameters of the model without adapters, initialised from `key` (the same
    numbers a run without LoRA starts from)."""
    model = Transformer(lora.base_spec(spec), rngs=nnx.Rngs(key))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def state_shardings(spec: ModelSpec, optimizer: optax.GradientTransformation,
                    mesh: Mesh, loss_scale: float | None = None,
                    offload_optimizer: bool = False, reference: bool = False) -> TrainState:
    """Shardings of the whole train state: optimizer moments mirror their parameters, in
    pinned host memory with offload_optimizer (they come to the device only for the update);
    the frozen models' by role: LoRA's base (in model.lora.base_dtype's stored form), and
    with `reference` a frozen reference copy of the parameters (DPO without LoRA), sharded
    as they are. Their fingerprints are replicated."""
    replicated = NamedSharding(mesh, P())
    params, frozen = param_shardings(abstract_model(spec), mesh, spec.rules), {}
    if spec.lora is not None:
        params, base = lora.split(params)
        frozen[BASE] = Frozen(stored_base_shardings(spec, base), replicated)
    if reference:
        frozen[REFERENCE] = Frozen(params, replicated)
    shapes = jax.eval_shape(functools.partial(_create_state, spec, optimizer, loss_scale),
                            jax.random.key(0))
    memory = "pinned_host" if offload_optimizer else "device"
    opt = optax.tree_map_params(optimizer,
                                lambda _, sharding: sharding.with_memory_kind(memory),
                                shapes.opt_state, params,
                                transform_non_params=lambda _: replicated,
                                is_leaf=lambda x: isinstance(x, NamedSharding))
    scale = None if loss_scale is None else LossScale(replicated, replicated)
    return TrainState(step=replicated, params=params, opt_state=opt, loss_scale=scale,
                      frozen=frozen)


def base_axes(spec: ModelSpec) -> dict:
    """{path: logical axes} of the model without adapters (LoRA's frozen base)."""
    return param_axes(abstract_model(lora.base_spec(spec)))


def stored_base_shardings(spec: ModelSpec, shardings: dict) -> dict:
    """The frozen base's shardings in model.lora.base_dtype's stored form, from its
    float32 parameters' (the same tree for float32)."""
    storage = base_storage.STORAGES[spec.lora.base_dtype]
    if storage.name == "float32":
        return shardings
    shapes = jax.eval_shape(functools.partial(create_base, spec), jax.random.key(0))
    return base_storage.stored_shardings(storage, shapes, shardings, base_axes(spec))


def stored_base(spec: ModelSpec, base: dict) -> dict:
    """The frozen base parameters in model.lora.base_dtype's form (float32: themselves)."""
    storage = base_storage.STORAGES[spec.lora.base_dtype]
    return base_storage.store(storage, base, base_axes(spec))


def _loaded_apart(shardings: TrainState) -> TrainState:
    """The shardings of what _create_state makes: no frozen models, which are loaded apart
    (train/frozen.py)."""
    return shardings.replace(frozen={})


def _with_fingerprints(state: TrainState, shardings: TrainState, make) -> TrainState:
    """`state` with a fingerprint (make(its sharding)) for each frozen model, whose
    parameters are still to load."""
    return state.replace(frozen={role: Frozen(None, make(frozen.fingerprint))
                                 for role, frozen in shardings.frozen.items()})


def init_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
               shardings: TrainState, seed: int, loss_scale: float | None = None) -> TrainState:
    """The state created directly in its shards by one jit: no device holds it whole."""
    mesh = shardings.step.mesh
    with jax.set_mesh(mesh):
        state = jax.jit(functools.partial(_create_state, spec, optimizer, loss_scale),
                        out_shardings=_loaded_apart(shardings))(jax.random.key(seed))
    return _with_fingerprints(
        state, shardings, lambda sh: jax.device_put(jnp.zeros((8,), jnp.uint32), sh))


def on_device(shardings):
    """The same shardings in device memory (for moments offloaded to the host)."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def abstract_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
                   shardings: TrainState, loss_scale: float | None = None) -> TrainState:
    """ShapeDtypeStructs with shardings, for restoring a checkpoint straight into shards."""
    shapes = jax.eval_shape(functools.partial(_create_state, spec, optimizer, loss_scale),
                            jax.random.key(0))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         shapes, _loaded_apart(shardings))
    return _with_fingerprints(
        state, shardings, lambda sh: jax.ShapeDtypeStruct((8,), jnp.uint32, sharding=sh))


def abstract_step_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
                        shardings: TrainState, loss_scale: float | None = None) -> TrainState:
    """abstract_state plus the frozen models' parameters (LoRA's base as stored, DPO's
    reference copy) as ShapeDtypeStructs: everything the jitted step takes, for an
    ahead-of-time compile (plan --compile) that allocates nothing."""
    state = abstract_state(spec, optimizer, shardings, loss_scale)
    shapes = jax.eval_shape(functools.partial(create_base, spec), jax.random.key(0))
    by_role = {BASE: lambda: jax.eval_shape(functools.partial(stored_base, spec), shapes),
               REFERENCE: lambda: shapes}
    return state.replace(frozen={
        role: frozen.replace(params=jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            by_role[role](), shardings.frozen[role].params))
        for role, frozen in state.frozen.items()})
