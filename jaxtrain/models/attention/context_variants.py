"""How K/V reach every device of a context group (`model.context_attention`): the
VARIANTS registry of the context-parallel kernel (context.py).

- **allgather**: the row's K/V (and key segment ids) all-gathered over `context` once, then
  visited block by block. One collective; the device holds the row's K/V. Backward: the
  gathered blocks' dK/dV summed back to their owners with one reduce-scatter.
- **ring**: the device starts with its own block and, C−1 times, passes the block it holds
  to the next device and takes the previous one's (lax.ppermute): after s hops it holds
  device (i − s) mod C's block. A device never holds more than two blocks, and each hop's
  transfer can overlap the previous block's compute. Backward: each block passed on with
  its dK/dV, and one last hop takes them home.

Both visit the other blocks in the same order, so they sum alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtrain.errors import fail
from jaxtrain.models.attention.context_tiles import (
    AXIS,
    KEY_TILE,
    MIN_TILE,
    QUERY_TILE,
    Device,
    block_grads,
    fold_block,
    tile_size,
)


def _pass_on(tree, size: int):
    """Every array of `tree` to the next device of the ring."""
    shift = [(j, (j + 1) % size) for j in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, shift), tree)


def _ring_forward(dev: Device, acc, block):
    """The C−1 other blocks, each passed on one hop at a time."""
    size, me = dev.spec.size, dev.me

    def hop(carry, s):
        acc, block = carry
        block = _pass_on(block, size)
        return (fold_block(dev, acc, block, dev.table_CT[(me - s) % size]), block), None

    (acc, _), _ = jax.lax.scan(hop, (acc, block), jnp.arange(1, size))
    return acc


def _allgather_forward(dev: Device, acc, block):
    """The row's blocks gathered once, visited in the ring's order."""
    size, me = dev.spec.size, dev.me
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS, axis=0), block)

    def visit(acc, s):
        j = (me - s) % size  # the ring's order, so both variants sum alike
        return fold_block(dev, acc, jax.tree.map(lambda x: x[j], gathered),
                           dev.table_CT[j]), None

    acc, _ = jax.lax.scan(visit, acc, jnp.arange(1, size))
    return acc


def _ring_backward(dev: Device, grads_in, block, dq, dk_BGTK, dv_BGTK):
    """(dQ, this block's dK, dV): each block passed on with the dK/dV summed so far, and
    one last hop home to the block's owner."""
    size, me = dev.spec.size, dev.me

    def hop(carry, s):
        dq, block, dk, dv = carry
        block, dk, dv = _pass_on((block, dk, dv), size)
        dq, dk_s, dv_s = block_grads(dev, dq, grads_in, block,
                                      dev.table_CT[(me - s) % size])
        return (dq, block, dk + dk_s, dv + dv_s), None

    (dq, _, dk_BGTK, dv_BGTK), _ = jax.lax.scan(hop, (dq, block, dk_BGTK, dv_BGTK),
                                                jnp.arange(1, size))
    dk_BGTK, dv_BGTK = _pass_on((dk_BGTK, dv_BGTK), size)  # home: the block's owner
    return dq, dk_BGTK, dv_BGTK


def _allgather_backward(dev: Device, grads_in, block, dq, dk_BGTK, dv_BGTK):
    """(dQ, this block's dK, dV): the gathered blocks' dK/dV summed back to their owners
    with one reduce-scatter."""
    size, me = dev.spec.size, dev.me
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS, axis=0), block)
    dk_all = jnp.zeros((size,) + dk_BGTK.shape, jnp.float32).at[me].set(dk_BGTK)
    dv_all = jnp.zeros((size,) + dv_BGTK.shape, jnp.float32).at[me].set(dv_BGTK)

    def visit(carry, s):
        dq, dk_all, dv_all = carry
        j = (me - s) % size
        dq, dk_j, dv_j = block_grads(dev, dq, grads_in,
                                      jax.tree.map(lambda x: x[j], gathered),
                                      dev.table_CT[j])
        return (dq, dk_all.at[j].add(dk_j), dv_all.at[j].add(dv_j)), None

    (dq, dk_all, dv_all), _ = jax.lax.scan(visit, (dq, dk_all, dv_all),
                                           jnp.arange(1, size))
    dk_BGTK, dv_BGTK = (jax.lax.psum_scatter(x, AXIS, scatter_dimension=0)
                        for x in (dk_all, dv_all))
    return dq, dk_BGTK, dv_BGTK


def check_mesh(c, sizes: dict[str, int]) -> None:
    """What the context kernel (either variant) cannot run: query tiles of a few positions
    (a run with no divisor in MIN_TILE..QUERY_TILE), a pipeline."""
    size = sizes.get("context", 1)
    if size == 1:
        return
    m, runs = c.model, size * (2 if c.mesh.context_load_balance else 1)
    run = m.seq_len // runs
    # A long run with no divisor of MIN_TILE..QUERY_TILE would loop over tiles of a few
    # positions (a prime run: one).
    query_tile = tile_size(run, QUERY_TILE)
    if query_tile < min(run, MIN_TILE):
        fail("model.seq_len", m.seq_len, f"leaves runs of {run} positions per context "
             f"chunk, whose largest divisor up to {QUERY_TILE} is {query_tile}: the attention "
             f"would run in tiles of {query_tile}; pick a length whose run has a divisor in "
             f"{MIN_TILE}..{QUERY_TILE}")
    if c.mesh.pipeline != 1 or c.mesh.dcn_pipeline != 1:
        fail("mesh.pipeline", c.mesh.pipeline, f"mesh.context={size} does not run under a "
             "pipeline yet; use mesh.pipeline=1")


@dataclasses.dataclass(frozen=True)
class ContextVariant:
    """One `model.context_attention` value: how K/V reach every device of a context group,
    its checks, and the facts the planner counts its memory and traffic from."""

    name: str
    doc: str
    forward: Callable  # (device, accumulators, own block) -> accumulators, other blocks in
    backward: Callable  # (device, grads_in, own block, dq, dk, dv) -> (dq, dk, dv)
    grouped_kv: bool  # 'auto' picks it when kv heads are grouped (GQA/MQA), else not
    # (config, mesh axis sizes) -> None, raising ConfigError.
    check: Callable | None = None
    # Planner: K/V blocks a device holds at once (None: the whole row's C blocks),
    kv_blocks: int | None = None
    # and whether the other blocks arrive in C−1 dependent hops (else one collective),
    hops: bool = False
    # and the most (query, key) positions of one score tile of a visited block (both
    # variants visit blocks in context_tiles.py's tiles).
    score_tile: tuple[int, int] = (QUERY_TILE, KEY_TILE)

    def validate(self, c, sizes: dict[str, int]) -> None:
        if self.check is not None:
            self.check(c, sizes)


VARIANTS: dict[str, ContextVariant] = {v.name: v for v in (
    ContextVariant("allgather", "the row's K/V all-gathered once, then visited block by "
                   "block", _allgather_forward, _allgather_backward, grouped_kv=True,
                   check=check_mesh),
    ContextVariant("ring", "each block passed on around the ring (lax.ppermute), at most "
                   "two held", _ring_forward, _ring_backward, grouped_kv=False,
                   check=check_mesh, kv_blocks=2, hops=True),
)}


def variant_choices() -> tuple[str, ...]:
    """model.context_attention's valid values (read when asked)."""
    return ("auto", *VARIANTS)


def resolve_variant(name: str, num_heads: int, num_kv_heads: int) -> str:
    """`auto`: the variant for grouped kv heads (GQA/MQA: K/V are a fraction of the
    activations, so holding the row's K/V costs little and one collective replaces C−1
    dependent hops: allgather), else the other (each hop's transfer overlaps a block's
    compute, and a device holds only two K/V blocks: ring)."""
    if name != "auto":
        return name
    grouped = num_kv_heads < num_heads
    return next(v.name for v in VARIANTS.values() if v.grouped_kv == grouped)
