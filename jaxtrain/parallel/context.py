"""Context parallelism: the sequence split over the `context` mesh axis, and its layout.

Every per-position activation is sharded along its sequence dimension over `context`
(the `length` and `sequence` logical rules), so each of the C devices of a context group
holds T = L/C positions of each row between and inside the blocks; only attention needs the
other positions' keys and values (models/attention/context.py).

**Load balance.** With a plain split, device C−1 holds the last positions, whose causal
prefix is the whole row, and device 0 the first, which see only themselves: the causal work
grows linearly with the device index. With `mesh.context_load_balance` the row is cut into
2C chunks and device i holds chunks i and 2C−1−i (zig-zag, as Megatron's and torchtitan's
context parallelism do): every device then has one early and one late chunk and the same
number of causal (query, key) pairs. The reordering is one static permutation of the
sequence axis, applied at the batch boundary (train/step.py) to inputs, targets, segment
ids and positions alike; the loss is a sum over tokens, so nothing needs it undone.
`causal_pairs` reports the per-device work of either layout.

The model never reads the layout: positions for RoPE come with the batch (permuted like the
tokens), and the attention kernel derives each slot's position in the row from the layout
and its device index (`slot_positions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ContextSpec:
    """The context axis as the model sees it: its size, how attention gathers K/V, and
    whether the row is in the zig-zag order."""

    size: int
    variant: str  # a models/attention/context_variants.py VARIANTS entry (resolved from auto)
    load_balance: bool
    # Measurement only (tests, scripts/table_context_balance.py): called (device index along
    # context, FLOPs) by every (query tile, key tile) pair the attention kernel computes,
    # forward and backward, as the compiled step runs; None (training) traces no callback.
    count_work: Callable | None = None

    def describe(self) -> str:
        return f"{self.variant} K/V, {'zig-zag' if self.load_balance else 'plain split'}"

    @property
    def chunks_per_device(self) -> int:
        """Contiguous runs of positions per device: two (early, late) when balanced."""
        return 2 if self.load_balance else 1

    def order(self, length: int) -> np.ndarray:
        """[L]: the row position held by each slot of the laid-out (sharded) sequence."""
        return self.slot_positions(length).reshape(length)

    def slot_positions(self, length: int) -> np.ndarray:
        """[C, T] int32: the row positions device i holds, in its slot order."""
        return slot_positions(self.size, length, self.load_balance)


def slot_positions(size: int, length: int, load_balance: bool) -> np.ndarray:
    """[C, T] int32: the row positions device i of `size` holds, in its slot order (the
    layout alone: how K/V travel does not change it)."""
    if not load_balance:
        return np.arange(length, dtype=np.int32).reshape(size, length // size)
    chunks = np.arange(length, dtype=np.int32).reshape(2 * size, length // (2 * size))
    return np.concatenate([chunks[:size], chunks[size:][::-1]], axis=1)


def to_layout(x_BL, spec: ContextSpec | None):
    """x [B, L, ...] in row order -> the context layout (identity unless load-balanced)."""
    if spec is None or not spec.load_balance:
        return x_BL
    return jnp.take(x_BL, jnp.asarray(spec.order(x_BL.shape[1])), axis=1)


def causal_pairs(size: int, length: int, load_balance: bool, window: int = 0) -> np.ndarray:
    """[C]: the (query, key) pairs each device's queries attend to under the causal (and
    sliding-window) mask: its attention work. max/mean − 1 is the imbalance."""
    pos_CT = slot_positions(size, length, load_balance).astype(np.int64)
    keys_CT = pos_CT + 1 if not window else np.minimum(pos_CT + 1, window)
    return keys_CT.sum(axis=1)


def imbalance(size: int, length: int, load_balance: bool, window: int = 0) -> float:
    """The busiest device's causal work over the mean, minus one (0: balanced)."""
    pairs = causal_pairs(size, length, load_balance, window)
    return float(pairs.max() / pairs.mean() - 1)
