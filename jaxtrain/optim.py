"""Optimizer: AdamW with warmup and decay, global-norm clipping, a weight-decay mask, and
skipping of non-finite steps."""

from __future__ import annotations

import jax
import optax

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


def decay_mask(params, decay_embeddings: bool):
    """Decay matmul weights (w_*, lm_head); never norms or biases; embeddings if asked."""
    def decays(path, _):
        name = path[-1].key
        return (name.startswith("w_") or name == "lm_head"
                or (decay_embeddings and name in EMBEDDINGS))
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    o = cfg.optimizer
    schedule = make_schedule(cfg)
    adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=lambda p: decay_mask(p, o.decay_embeddings))
    inner = optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw) if o.clip_norm > 0 else adamw
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
    """(mu, nu): Adam's first and second moments, trees shaped like the parameters."""
    return optax.tree_utils.tree_get(opt_state, "mu"), optax.tree_utils.tree_get(opt_state, "nu")
