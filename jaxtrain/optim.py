"""Optimizer: one OPTIMIZERS entry (AdamW, Lion) with warmup and decay, global-norm
clipping, a weight-decay mask, and skipping of non-finite steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import optax

from jaxtrain.models import lora

EMBEDDINGS = ("tok_embed", "pos_embed")
NEVER = 2**31 - 1


# optimizer.schedule -> the learning rate after warm-up: (peak, min_lr_ratio, steps) ->
# optax schedule over those steps.
SCHEDULES = {
    "cosine": lambda peak, ratio, steps: optax.cosine_decay_schedule(peak, steps, alpha=ratio),
    "linear": lambda peak, ratio, steps: optax.linear_schedule(peak, peak * ratio, steps),
    "constant": lambda peak, ratio, steps: optax.constant_schedule(peak),
}


def make_schedule(cfg) -> optax.Schedule:
    o = cfg.optimizer
    peak = o.lr
    warmup = min(o.warmup_steps, cfg.steps)
    decay_steps = max(cfg.steps - warmup, 1)
    after = SCHEDULES[o.schedule](peak, o.min_lr_ratio, decay_steps)
    if warmup == 0:
        return after
    # Warm up from lr/warmup rather than 0 so that the first step already moves the weights.
    return optax.join_schedules([optax.linear_schedule(peak / warmup, peak, warmup), after],
                                [warmup])


def decay_mask(params, decay_embeddings: bool, decay_adapters: bool = True):
    """Decay matmul weights (w_*, lm_head) and LoRA's adapters (lora_*/a, b: the weights a
    LoRA run trains) unless told not to; never norms or biases; embeddings if asked."""
    def decays(path, _):
        keys = tuple(getattr(k, "key", k) for k in path)
        if lora.is_adapter(keys):
            return decay_adapters
        name = keys[-1]
        return (name.startswith("w_") or name == "lm_head"
                or (decay_embeddings and name in EMBEDDINGS))
    return jax.tree_util.tree_map_with_path(decays, params)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One `optimizer.name` value: the optax update rule, its checks, and the planner's
    fact about its state."""

    name: str
    doc: str
    # (schedule, cfg.optimizer, decay mask: params -> bool tree) -> the update rule, before
    # clipping and the non-finite skip (make_optimizer adds both).
    make: Callable
    # Planner: float32 values of optimizer state per parameter (sharded like the params).
    state_per_param: int
    check: Callable | None = None  # (config) -> None, raising ConfigError

    def validate(self, c) -> None:
        if self.check is not None:
            self.check(c)


def _adamw(schedule, o, mask):
    return optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=mask)


def _lion(schedule, o, mask):
    # Lion's update is a sign: every entry moves by lr, so it wants 3-10× AdamW's lr
    # smaller and its weight decay that much larger (Chen et al. 2023).
    return optax.lion(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=mask)


OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("adamw", "Adam with decoupled weight decay (b1, b2, eps)", _adamw,
              state_per_param=2),
    Optimizer("lion", "Lion (sign of an interpolated momentum; b1, b2): one moment, half "
              "AdamW's state", _lion, state_per_param=1),
)}


def defaults() -> dict:
    """The `optimizer` section of config.base_config()."""
    return {
        "name": "adamw",  # OPTIMIZERS: adamw, lion
        "lr": 3e-4,
        "warmup_steps": 10,
        "schedule": "cosine",
        "min_lr_ratio": 0.1,
        "weight_decay": 0.1,
        "decay_embeddings": False,
        "b1": 0.9,
        "b2": 0.95,
        "eps": 1e-8,
        "clip_norm": 1.0,
        # Keep the Adam moments in pinned host memory between steps (GPU/TPU memory saver).
        "offload_to_host": False,
    }


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    o = cfg.optimizer
    schedule = make_schedule(cfg)
    decay_adapters = bool(cfg.model.lora.weight_decay)
    rule = OPTIMIZERS[o.name].make(schedule, o, lambda p: decay_mask(p, o.decay_embeddings,
                                                                     decay_adapters))
    inner = optax.chain(optax.clip_by_global_norm(o.clip_norm), rule) if o.clip_norm > 0 \
        else rule
    # A step with non-finite gradients leaves params and moments untouched, however many come
    # in a row: the loop, not optax, stops the run after train.max_consecutive_bad_steps.
    return optax.apply_if_finite(inner, max_consecutive_errors=NEVER), schedule


# Readers of the state of the optimizer make_optimizer builds, so that nothing else depends
# on how its transformations are nested.

def skipped_steps(opt_state) -> tuple:
    """(steps skipped so far, non-finite steps in a row up to now): optax.apply_if_finite's
    counters."""
    return (optax.tree_utils.tree_get(opt_state, "total_notfinite"),
            optax.tree_utils.tree_get(opt_state, "notfinite_count"))


def adam_moments(opt_state) -> tuple:
    """(mu, nu): Adam's first and second moments, trees shaped like the parameters (None
    for a moment the optimizer does not keep: Lion has no nu)."""
    return optax.tree_utils.tree_get(opt_state, "mu"), optax.tree_utils.tree_get(opt_state, "nu")
