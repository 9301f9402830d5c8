"""The pure train and eval steps, and their jitted, sharded forms."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxtrain.mesh import logical_to_spec
from jaxtrain.models.head_loss import head_cross_entropy
from jaxtrain.train.state import TrainState


def loss_fn(params: dict, graphdef: nnx.GraphDef, tokens_BT: jax.Array) -> jax.Array:
    """Mean next-token cross entropy; tokens_BT holds seq_len + 1 tokens per row.

    Equals softmax cross entropy of model(inputs) logits, but the head and the loss run fused
    over sequence chunks (models/head_loss.py) so the B·L·V logits never exist at once.
    """
    inputs_BL, targets_BL = tokens_BT[:, :-1], tokens_BT[:, 1:]
    model = nnx.merge(graphdef, params)
    head, vocab_major = model.head_as_stored()
    return head_cross_entropy(model.features(inputs_BL), head, targets_BL, model.spec.rules,
                              vocab_major)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, microbatches: int, rules,
                    nan_steps: tuple[int, int] | None = None,
                    constants: dict | None = None,
                    loss_scale_period: int = 2000,
                    opt_device_shardings=None) -> Callable:
    """The pure step. nan_steps=(first, count) poisons those steps' loss (tests only);
    constants are logged with every step's metrics; with a LossScale in the state (float16)
    the loss is scaled before differentiation and the gradients unscaled after;
    opt_device_shardings (optimizer state offloaded to host memory) brings it to the device
    for the update, and the jit's out_shardings send it back."""

    def objective(params, tokens_BT, step, scale):
        loss = loss_fn(params, graphdef, tokens_BT)
        if nan_steps is not None:
            first, count = nan_steps
            loss = loss * jnp.where((step >= first) & (step < first + count), jnp.nan, 1.0)
        return loss if scale is None else loss * scale

    grad_fn = jax.value_and_grad(objective)

    def scaled_loss_and_grads(params, tokens_BT, step, scale):
        if microbatches == 1:
            return grad_fn(params, tokens_BT, step, scale)
        b, t = tokens_BT.shape
        # Micro-batch i takes rows i, i+m, i+2m, ...: each device's contiguous block of rows
        # holds its share of every micro-batch, so splitting moves no data between devices.
        micro_MBT = tokens_BT.reshape(b // microbatches, microbatches, t).swapaxes(0, 1)
        micro_MBT = jax.lax.with_sharding_constraint(
            micro_MBT, logical_to_spec((None, "batch", None), rules))

        def accumulate(carry, tokens):
            loss, grads = grad_fn(params, tokens, step, scale)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(accumulate, zeros, micro_MBT)
        return jax.tree.map(lambda x: x / microbatches, (loss, grads))

    def train_step(state: TrainState, tokens_BT: jax.Array) -> tuple[TrainState, dict]:
        scale = None if state.loss_scale is None else state.loss_scale.scale
        loss, grads = scaled_loss_and_grads(state.params, tokens_BT, state.step, scale)
        loss_scale, extra = state.loss_scale, {}
        if scale is not None:
            loss, grads = jax.tree.map(lambda x: x / scale, (loss, grads))
            finite = jnp.isfinite(optax.tree.norm(grads))
            loss_scale = state.loss_scale.update(finite, loss_scale_period)
            extra = {"loss_scale": scale}
        opt_state = state.opt_state
        if opt_device_shardings is not None:
            opt_state = jax.device_put(opt_state, opt_device_shardings)
        updates, opt_state = optimizer.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "learning_rate": schedule(state.step),
                   # optax.apply_if_finite's counters: all skipped steps, and the current run.
                   "skipped_steps": opt_state.total_notfinite,
                   "bad_steps_in_a_row": opt_state.notfinite_count, **extra,
                   **(constants or {})}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                          loss_scale=loss_scale), metrics

    return train_step


def jit_train_step(train_step: Callable, shardings: TrainState,
                   batch_sharding: NamedSharding) -> Callable:
    """Explicit in/out shardings; the old state is donated so its buffers are reused."""
    return jax.jit(train_step, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, None), donate_argnums=0)


def jit_eval_step(graphdef: nnx.GraphDef, param_shardings: dict,
                  batch_sharding: NamedSharding) -> Callable:
    return jax.jit(lambda params, tokens: loss_fn(params, graphdef, tokens),
                   in_shardings=(param_shardings, batch_sharding))


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch", None), rules))
