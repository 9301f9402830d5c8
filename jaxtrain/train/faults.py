"""Fault injection for testing the run's defences (config section `debug`): a NaN loss at
chosen steps, as a wrapper around the loss the train step differentiates."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp


def poisoned(loss: Callable, first: int, count: int) -> Callable:
    """loss, but NaN at steps [first, first + count)."""

    def poisoned_loss(params, tokens_BT, step):
        value = loss(params, tokens_BT, step)
        return value * jnp.where((step >= first) & (step < first + count), jnp.nan, 1.0)

    return poisoned_loss


def loss_with_faults(loss: Callable, debug_cfg) -> Callable:
    """The loss with the faults the config's `debug` section asks for (none by default)."""
    if debug_cfg.nan_from_step >= 0:
        return poisoned(loss, debug_cfg.nan_from_step, debug_cfg.nan_steps)
    return loss
