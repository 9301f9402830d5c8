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


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict  # the trained nnx.Param values (pure nested dict); LoRA: the adapters
    opt_state: Any
    loss_scale: LossScale | None = None  # float16 precision only
    # Parameters the model reads and the step never changes (no gradient, no optimizer
    # state, not checkpointed): LoRA's base. model_params() joins them with `params`.
    frozen: dict | None = None
    # uint32[8]: sha256 of the frozen base's per-leaf bit sums (train/frozen.py), which a
    # checkpoint holds so that a resume refuses another base.
    base_fingerprint: jax.Array | None = None
    # DPO without LoRA (objectives.py): the frozen reference parameters, a copy of the
    # starting ones (train/reference.py); like `frozen`, never checkpointed but loaded
    # again, and its fingerprint (uint32[8]) checkpointed so that a resume refuses another.
    reference: dict | None = None
    reference_fingerprint: jax.Array | None = None

    def tree(self) -> dict:
        """The checkpointed tree: absent fields (loss_scale outside float16) are left out,
        since orbax cannot restore into a None; the frozen base is never in it."""
        tree = {"step": self.step, "params": self.params, "opt_state": self.opt_state}
        if self.loss_scale is not None:
            tree["loss_scale"] = self.loss_scale
        if self.base_fingerprint is not None:
            tree["base_fingerprint"] = self.base_fingerprint
        if self.reference_fingerprint is not None:
            tree["reference_fingerprint"] = self.reference_fingerprint
        return tree

    def model_params(self) -> dict:
        """Every parameter of the model (what nnx.merge with the run's graphdef takes)."""
        return self.params if self.frozen is None else lora.join(self.frozen, self.params)

    def reference_params(self) -> dict | None:
        """The frozen parameters a reference model runs on (objectives.py): DPO's copy,
        else LoRA's base (the model without adapters); None without either."""
        return self.frozen if self.reference is None else self.reference

    @classmethod
    def from_tree(cls, tree: dict) -> TrainState:
        return cls(**tree)


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
    fingerprint = None
    if spec.lora is not None:  # XLA drops the base weights drawn here: only adapters leave
        params = lora.split(params)[0]
        fingerprint = jnp.zeros((8,), jnp.uint32)
    scale = None if loss_scale is None else LossScale(
        scale=jnp.asarray(loss_scale, jnp.float32), good_steps=jnp.zeros((), jnp.int32))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), loss_scale=scale,
                      base_fingerprint=fingerprint)


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
    `reference`: the state holds a frozen reference copy of the parameters (DPO without
    LoRA), sharded as they are."""
    replicated = NamedSharding(mesh, P())
    params, frozen = param_shardings(abstract_model(spec), mesh, spec.rules), None
    if spec.lora is not None:
        params, frozen = lora.split(params)
        frozen = stored_base_shardings(spec, frozen)
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
                      frozen=frozen,
                      base_fingerprint=None if frozen is None else replicated,
                      reference=params if reference else None,
                      reference_fingerprint=replicated if reference else None)


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
    """The shardings of what _create_state makes: not the frozen parameters, which are
    loaded apart (train/frozen.py, train/reference.py), nor the reference's fingerprint."""
    return shardings.replace(frozen=None, reference=None, reference_fingerprint=None)


def _with_reference_fingerprint(state: TrainState, shardings: TrainState,
                                make) -> TrainState:
    sharding = shardings.reference_fingerprint
    return state if sharding is None else state.replace(reference_fingerprint=make(sharding))


def init_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
               shardings: TrainState, seed: int, loss_scale: float | None = None) -> TrainState:
    """The state created directly in its shards by one jit: no device holds it whole."""
    mesh = shardings.step.mesh
    with jax.set_mesh(mesh):
        state = jax.jit(functools.partial(_create_state, spec, optimizer, loss_scale),
                        out_shardings=_loaded_apart(shardings))(jax.random.key(seed))
    return _with_reference_fingerprint(
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
    return _with_reference_fingerprint(
        state, shardings, lambda sh: jax.ShapeDtypeStruct((8,), jnp.uint32, sharding=sh))


def abstract_step_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
                        shardings: TrainState, loss_scale: float | None = None) -> TrainState:
    """abstract_state plus the parameters loaded apart (LoRA's frozen base, DPO's reference
    copy) as ShapeDtypeStructs: everything the jitted step takes, for an ahead-of-time
    compile (plan --compile) that allocates nothing."""
    state = abstract_state(spec, optimizer, shardings, loss_scale)
    shapes = jax.eval_shape(functools.partial(create_base, spec), jax.random.key(0))

    def shaped(tree_shardings):
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, tree_shardings)

    if shardings.frozen is not None:
        stored = jax.eval_shape(functools.partial(stored_base, spec), shapes)
        state = state.replace(frozen=jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            stored, shardings.frozen))
    if shardings.reference is not None:
        state = state.replace(reference=shaped(shardings.reference))
    return state

