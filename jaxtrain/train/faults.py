"""Fault injection for testing the run's defences (config section `debug`): a NaN loss at
chosen steps (a wrapper around the loss the train step differentiates), and an input
pipeline that hangs at a chosen step (for the hang watchdog)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import jax.numpy as jnp


def poisoned(loss: Callable, first: int, count: int) -> Callable:
    """loss, but NaN at steps [first, first + count)."""

    def poisoned_loss(params, tokens_BT, step, reference=None):
        value, metrics = loss(params, tokens_BT, step, reference)
        return value * jnp.where((step >= first) & (step < first + count), jnp.nan, 1.0), metrics

    return poisoned_loss


def loss_with_faults(loss: Callable, debug_cfg) -> Callable:
    """The loss with the faults the config's `debug` section asks for (none by default)."""
    if debug_cfg.nan_from_step >= 0:
        return poisoned(loss, debug_cfg.nan_from_step, debug_cfg.nan_steps)
    return loss


def data_with_faults(batches: Iterator, debug_cfg, start: int) -> Iterator:
    """The batches, but the one for step debug.hang_at_step never comes (a stuck reader)."""
    hang_at = debug_cfg.hang_at_step
    for step, batch in enumerate(batches, start):
        if step == hang_at:
            threading.Event().wait()
        yield batch
