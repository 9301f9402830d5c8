"""Train state and its shardings; parameters are born sharded."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.mesh import named_sharding
from jaxtrain.models import ModelSpec, Transformer


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict  # pure nested dict of arrays, the model's nnx.Param values
    opt_state: Any


def abstract_model(spec: ModelSpec) -> Transformer:
    return nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0)))


def param_shardings(model: Transformer, mesh: Mesh, rules) -> dict:
    """NamedSharding per parameter, from the logical axes each nnx.Param carries."""
    leaves = jax.tree_util.tree_flatten_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    flat = {tuple(k.key for k in path): named_sharding(mesh, var.get_metadata()["axes"], rules)
            for path, var in leaves}
    return traverse_util.unflatten_dict(flat)


def _create_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
                  key: jax.Array) -> TrainState:
    params = nnx.to_pure_dict(nnx.state(Transformer(spec, rngs=nnx.Rngs(key)), nnx.Param))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))


def state_shardings(spec: ModelSpec, optimizer: optax.GradientTransformation,
                    mesh: Mesh) -> TrainState:
    """Shardings of the whole train state: optimizer moments mirror their parameters."""
    replicated = NamedSharding(mesh, P())
    params = param_shardings(abstract_model(spec), mesh, spec.rules)
    shapes = jax.eval_shape(functools.partial(_create_state, spec, optimizer),
                            jax.random.key(0))
    opt = optax.tree_map_params(optimizer, lambda _, sharding: sharding, shapes.opt_state,
                                params, transform_non_params=lambda _: replicated,
                                is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(step=replicated, params=params, opt_state=opt)


def init_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
               shardings: TrainState, seed: int) -> TrainState:
    """The state created directly in its shards by one jit: no device holds it whole."""
    mesh = shardings.step.mesh
    with jax.set_mesh(mesh):
        return jax.jit(functools.partial(_create_state, spec, optimizer),
                       out_shardings=shardings)(jax.random.key(seed))


def abstract_state(spec: ModelSpec, optimizer: optax.GradientTransformation,
                   shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs with shardings, for restoring a checkpoint straight into shards."""
    shapes = jax.eval_shape(functools.partial(_create_state, spec, optimizer),
                            jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
