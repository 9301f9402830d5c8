"""The pure train and eval steps, and their jitted, sharded forms."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxtrain.data.packing import Packed, batch_targets, counted_targets  # noqa: F401
from jaxtrain.mesh import logical_to_spec
from jaxtrain.models import lora
from jaxtrain.objectives import lm_sums, loss_fn, objective_fn  # noqa: F401 (their old home)
from jaxtrain.optim import skipped_steps
from jaxtrain.rl.objective import rollout_logps
from jaxtrain.train.state import BASE, TrainState


def trained_tokens(batch) -> jax.Array | None:
    """The input tokens of a batch that are no padding (what MFU counts); None for plain
    windows, which have none."""
    if not isinstance(batch, Packed):
        return None
    return (batch.segments[:, :-1] != 0).sum(dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the step runs, beyond the model and the optimizer."""

    microbatches: int = 1  # gradient accumulation: micro-batches per step, scanned
    loss_scale_period: int = 2000  # float16: finite steps in a row before the scale doubles
    constants: tuple = ()  # (name, value) pairs logged with every step's metrics
    # Optimizer state offloaded to host memory: its device shardings, to bring it to the
    # device for the update (the jit's out_shardings send it back).
    opt_device_shardings: Any = None
    # Packed rows' micro-batches weighted by their shares of the counted targets (the lm
    # objective's mean over targets); False: equally (dpo: the mean over pairs). The
    # objective's `weighting` (objectives.py).
    weight_by_targets: bool = True
    # (params before, params after the optimizer, forward metrics) -> (params, metrics):
    # state the model moves outside the gradient (a router's correction bias,
    # models/router.py bias_update); None: none.
    after_update: Callable | None = None


def make_train_step(loss: Callable, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, rules, options: StepOptions = StepOptions()
                    ) -> Callable:
    """The pure step: (state, tokens_BT) -> (state, metrics).

    loss(params, tokens_BT, step, reference) -> (mean loss, metrics of the forward pass,
    which join the step's; a `loss` among them replaces the objective as the logged loss);
    `reference` is the state's frozen reference parameters (TrainState.reference_params:
    DPO's copy, or LoRA's base; None without), which objectives without one ignore. With
    a LossScale in the state (float16) the loss is scaled before differentiation and the
    gradients unscaled after."""
    loss_and_grads = _accumulated(_differentiated(loss), rules, options)

    def train_step(state: TrainState, tokens_BT: jax.Array) -> tuple[TrainState, dict]:
        scale = None if state.loss_scale is None else state.loss_scale.scale
        (value, forward), grads = loss_and_grads(state.params, tokens_BT, state.step, scale,
                                                 state.frozen_params(BASE),
                                                 state.reference_params())
        value, grads, loss_scale, extra = _unscaled(state, scale, value, grads,
                                                    options.loss_scale_period)
        opt_state = state.opt_state
        if options.opt_device_shardings is not None:
            opt_state = jax.device_put(opt_state, options.opt_device_shardings)
        updates, opt_state = optimizer.update(grads, opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if options.after_update is not None:
            params, forward = options.after_update(state.params, params, forward)
        skipped, in_a_row = skipped_steps(opt_state)
        metrics = {"loss": value, "grad_norm": optax.tree.norm(grads),
                   "learning_rate": schedule(state.step), "skipped_steps": skipped,
                   "bad_steps_in_a_row": in_a_row, **forward, **extra,
                   **dict(options.constants)}
        if (tokens := trained_tokens(tokens_BT)) is not None:
            metrics["trained_tokens"] = tokens
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                             loss_scale=loss_scale), metrics

    return train_step


def _differentiated(loss: Callable) -> Callable:
    """(params, tokens, step, scale, frozen, reference) -> ((scaled value, metrics),
    grads): the loss differentiated in the trained parameters (LoRA: the adapters alone,
    joined to the frozen base inside), times the loss scale when there is one."""
    def objective(params, tokens_BT, step, scale, frozen, reference):
        if frozen is not None:
            params = lora.join(frozen, params)
        value, metrics = loss(params, tokens_BT, step, reference)
        return (value if scale is None else value * scale), metrics

    return jax.value_and_grad(objective, has_aux=True)


def _micro_split(tokens_BT, microbatches: int, rules):
    """[B, ...] -> [M, B/M, ...]: micro-batch i takes rows i, i+m, i+2m, ...: each device's
    contiguous block of rows holds its share of every micro-batch, so splitting moves no
    data between devices. Any leaf with rows first: [B, T] tokens, a Rollouts' [B]
    advantages."""
    b, *rest = tokens_BT.shape
    micro_MBT = tokens_BT.reshape(b // microbatches, microbatches, *rest).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(
        micro_MBT, logical_to_spec((None, "batch", *[None] * len(rest)), rules))


def _accumulated(grad_fn: Callable, rules, options: StepOptions) -> Callable:
    """grad_fn over options.microbatches micro-batches, scanned: their mean (packed rows
    weighted by target shares when the objective counts targets)."""
    microbatches = options.microbatches

    def loss_and_grads(params, tokens_BT, step, scale, frozen, reference):
        if microbatches == 1:
            return grad_fn(params, tokens_BT, step, scale, frozen, reference)
        micro_MBT = jax.tree.map(lambda x: _micro_split(x, microbatches, rules), tokens_BT)
        # Packed rows: each micro-batch's mean weighted by its share of the counted targets
        # (loss mask included), so that the sum is the mean over the whole batch's.
        shares_M = (_target_shares(micro_MBT) if isinstance(tokens_BT, Packed)
                    and options.weight_by_targets else None)

        def accumulate(carry, xs):
            tokens, share = xs
            out = grad_fn(params, tokens, step, scale, frozen, reference)
            if share is not None:
                out = jax.tree.map(lambda x: x * share, out)
            return jax.tree.map(jnp.add, carry, out), None

        first = jax.tree.map(lambda a: a[0], micro_MBT)
        shapes = jax.eval_shape(grad_fn, params, first, step, scale, frozen, reference)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        totals, _ = jax.lax.scan(accumulate, zeros, (micro_MBT, shares_M))
        if shares_M is not None:
            return totals
        return jax.tree.map(lambda x: x / microbatches, totals)

    return loss_and_grads


def iterated_step(train_step: Callable, graphdef: nnx.GraphDef, iterations: int,
                  temperature: float) -> Callable:
    """GRPO's μ = `iterations` optimizer updates on one batch of rollouts, in one step
    (TRL's num_iterations): the sampling policy's log-probabilities (old_logps) are taken
    once from the step's starting parameters, then train_step runs μ times; the state's
    step advances by one (a step is one generation); its metrics are the last update's, the
    loss and grad_norm the updates' means.
    Everything is a function of the state and the batch, so a resume is bitwise."""
    def step(state: TrainState, rollouts):
        old_BT = rollout_logps(state.model_params(), graphdef, rollouts, temperature)
        rollouts = rollouts._replace(old_logps=old_BT)
        history = []
        for _ in range(iterations):
            state, metrics = train_step(state, rollouts)
            history.append(metrics)
        metrics = dict(history[-1])
        for key in ("loss", "grad_norm"):
            metrics[key] = jnp.mean(jnp.stack([m[key] for m in history]))
        return state.replace(step=state.step - (iterations - 1)), metrics

    return step


def _unscaled(state: TrainState, scale, value, grads, period: int):
    """(value, grads, the next loss scale, its metrics): under a loss scale (float16) the
    value and gradients divided by it, and the scale updated by whether they are finite."""
    if scale is None:
        return value, grads, state.loss_scale, {}
    value, grads = jax.tree.map(lambda x: x / scale, (value, grads))
    finite = jnp.isfinite(optax.tree.norm(grads))
    return value, grads, state.loss_scale.update(finite, period), {"loss_scale": scale}


def _target_shares(micro_MBT: Packed) -> jax.Array:
    """[M]: each micro-batch's counted targets over the whole batch's."""
    counts_M = jax.vmap(lambda b: batch_targets(b).sum(dtype=jnp.float32))(micro_MBT)
    return counts_M / jnp.maximum(counts_M.sum(), 1.0)


def jit_train_step(train_step: Callable, shardings: TrainState,
                   batch_sharding: NamedSharding) -> Callable:
    """Explicit in/out shardings; the old state is donated so its buffers are reused. The
    batch sharding applies to every array of a Packed batch (a pytree prefix)."""
    return jax.jit(train_step, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, None), donate_argnums=0)


def jit_eval_step(graphdef: nnx.GraphDef, param_shardings: dict,
                  batch_sharding: NamedSharding, evaluate: Callable | None = None,
                  reference_shardings: dict | None = None) -> Callable:
    """jit(eval)(params, tokens) -> the batch's sums and units (objectives.py
    Objective.losses): the cross entropy's, or `evaluate` (an objective's eval); with
    reference_shardings, eval(params, tokens, reference)."""
    if evaluate is None:
        evaluate = lambda params, tokens: lm_sums(params, graphdef, tokens)  # noqa: E731
    shardings = (param_shardings, batch_sharding)
    if reference_shardings is not None:
        shardings += (reference_shardings,)
    return jax.jit(evaluate, in_shardings=shardings)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch", None), rules))
