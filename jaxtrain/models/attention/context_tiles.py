"""One device's part of the context-parallel attention (context.py): its queries against one
visited K/V block of the row, in tiles.

A block is visited in tiles (flash.py): a loop over query tiles of ≤ QUERY_TILE positions
and, inside it, over key tiles of ≤ KEY_TILE, each tile folded into the output by the online
softmax (float32 running max, denominator and output), so the largest array the kernel makes
is one [query tile, key tile] score matrix, whatever the length. Masks come from global
positions: each slot's row position is a static function of the layout and the device index
(ContextSpec.slot_positions), so causality, the sliding window and the zig-zag order need
nothing from the batch; document masks compare the queries' segment ids with those that
travel with the keys.

Work: a device's slots are one (plain) or two (zig-zag) contiguous runs, and tiles never
straddle a run, so every tile pair the causal window hides entirely is skipped (lax.cond).
`computed_scores` predicts the scores each device computes; `ContextSpec.count_work`, where
set, counts the FLOPs of the tiles each device computes from inside the compiled step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models.attention import flash
from jaxtrain.models.attention.scaffold import fold_heads, to_groups, unfold_heads
from jaxtrain.parallel.context import ContextSpec

AXIS = "context"
# A run is visited in tiles of positions: query tiles are folded with their R heads into
# R·QUERY_TILE rows, so a score tile is [R·QUERY_TILE, KEY_TILE] float32 per (example, kv
# head). context_variants.check_mesh refuses a run whose query tiles would fall under
# MIN_TILE positions.
QUERY_TILE = 128
KEY_TILE = 512
MIN_TILE = 16


def tile_size(length: int, limit: int) -> int:
    """The largest divisor of a run's `length` that is at most `limit`: a tile's size."""
    return next(length // n for n in range(1, length + 1)
                if length % n == 0 and length // n <= limit)


class Device:
    """One device's view: its queries (grouped [B, G, R, T, K]), their row positions, the
    tile sizes, and the loops over (query tile, key tile) pairs of one visited block."""

    def __init__(self, q_BTHK, groups: int, segments_BT, spec: ContextSpec, window):
        t, heads = q_BTHK.shape[1:3]
        self.groups, self.r, self.window, self.spec = groups, heads // groups, window, spec
        self.q = to_groups(q_BTHK, groups)
        self.table_CT = jnp.asarray(spec.slot_positions(t * spec.size))
        self.me = jax.lax.axis_index(AXIS)
        self.positions_T = self.table_CT[self.me]
        self.segments_BT = segments_BT
        run = t // spec.chunks_per_device
        self.tq, self.tk = tile_size(run, QUERY_TILE), tile_size(run, KEY_TILE)
        self.nq, self.nk = t // self.tq, t // self.tk

    def query_tile(self, x_BGRTK, i):
        """Rows of query tile i of a [B, G, R, T, ...] array, heads folded: [B, G, R·tq, ...]."""
        return fold_heads(jax.lax.dynamic_slice_in_dim(x_BGRTK, i * self.tq, self.tq, 3))

    def put_query_tile(self, x_BGRTK, tile_BGQ, i):
        tile = unfold_heads(tile_BGQ, self.r)
        return jax.lax.dynamic_update_slice_in_dim(x_BGRTK, tile, i * self.tq, 3)

    def count(self, flops: int):
        """Reports a computed tile's FLOPs to the spec's work counter, where one is set
        (ContextSpec.count_work: measurement only, traced into the step)."""
        if self.spec.count_work is not None:
            jax.debug.callback(self.spec.count_work, self.me, flops)

    def pairs(self, block, positions_T, i, j):
        """Query tile i against key tile j of a block: (whether any key is visible, the
        mask, the key tile's k and v)."""
        k_BGTK, v_BGTK, segments_BT = block
        q_pos = jax.lax.dynamic_slice_in_dim(self.positions_T, i * self.tq, self.tq)
        k_pos = jax.lax.dynamic_slice_in_dim(positions_T, j * self.tk, self.tk)
        q_ids = k_ids = None
        if segments_BT is not None:
            q_ids = jnp.tile(jax.lax.dynamic_slice_in_dim(self.segments_BT, i * self.tq,
                                                          self.tq, 1), (1, self.r))
            k_ids = jax.lax.dynamic_slice_in_dim(segments_BT, j * self.tk, self.tk, 1)
        any_seen = flash.any_visible(q_pos[0], q_pos[-1], k_pos[0], k_pos[-1], self.window)
        seen = flash.visible(jnp.tile(q_pos, self.r), k_pos, self.window, q_ids, k_ids)
        keys = (jax.lax.dynamic_slice_in_dim(x, j * self.tk, self.tk, 2)
                for x in (k_BGTK, v_BGTK))
        return any_seen, seen, *keys


def fold_block(dev: Device, acc, block, positions_T):
    """The accumulators (o, m, l: [B, G, R, T, ...] float32) with a key block folded in."""

    def query_tile(i, acc):
        q_BGQK = dev.query_tile(dev.q, i)
        tile = tuple(dev.query_tile(x, i) for x in acc)

        def key_tile(j, tile):
            any_seen, seen, k_BGMK, v_BGMK = dev.pairs(block, positions_T, i, j)

            def fold(tile):
                dev.count(flash.tile_flops(q_BGQK, k_BGMK))
                return flash.fold(tile, q_BGQK, k_BGMK, v_BGMK, seen)

            return jax.lax.cond(any_seen, fold, lambda tile: tile, tile)

        tile = jax.lax.fori_loop(0, dev.nk, key_tile, tile)
        return tuple(dev.put_query_tile(x, t, i) for x, t in zip(acc, tile))

    return jax.lax.fori_loop(0, dev.nq, query_tile, acc)


def block_grads(dev: Device, dq_BGRTK, grads_in, block, positions_T):
    """(dQ with the block's share added, the block's dK and dV), float32."""
    do_BGRTK, lse_BGRT, delta_BGRT = grads_in
    k_BGTK = block[0]

    def key_tile(j, carry):
        def query_tile(i, carry):
            dq_BGRTK, dk_BGMK, dv_BGMK = carry
            any_seen, seen, k_blk, v_blk = dev.pairs(block, positions_T, i, j)

            def grads(carry):
                dq_BGRTK, dk_BGMK, dv_BGMK = carry
                q_BGQK = dev.query_tile(dev.q, i)
                # QKᵀ again, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q and dS·K: 5/2 of the forward's two.
                dev.count(flash.tile_flops(q_BGQK, k_blk) * 5 // 2)
                dq, dk, dv = flash.tile_grads(
                    q_BGQK, dev.query_tile(do_BGRTK, i), dev.query_tile(lse_BGRT, i),
                    dev.query_tile(delta_BGRT, i), k_blk, v_blk, seen)
                dq_BGRTK = dev.put_query_tile(dq_BGRTK, dev.query_tile(dq_BGRTK, i) + dq, i)
                return dq_BGRTK, dk_BGMK + dk, dv_BGMK + dv

            return jax.lax.cond(any_seen, grads, lambda carry: carry, carry)

        dq_BGRTK, dk_BGTK, dv_BGTK = carry
        b, g, _, head_dim = k_BGTK.shape
        zeros = jnp.zeros((b, g, dev.tk, head_dim), jnp.float32)
        dq_BGRTK, dk, dv = jax.lax.fori_loop(0, dev.nq, query_tile, (dq_BGRTK, zeros, zeros))
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=j * dev.tk,
                                axis=2)
        return dq_BGRTK, put(dk_BGTK, dk), put(dv_BGTK, dv)

    zeros = jnp.zeros(k_BGTK.shape, jnp.float32)
    return jax.lax.fori_loop(0, dev.nk, key_tile, (dq_BGRTK, zeros, zeros))


def computed_scores(spec: ContextSpec, length: int, window: int | None = None) -> np.ndarray:
    """[C]: the query×key scores each device's kernel computes per row and head (the
    (query tile, key tile) pairs the kernel does not skip, masked parts included): the work
    the step waits on, as ContextSpec.count_work measures it in the compiled step."""
    positions_CT = spec.slot_positions(length)
    run = positions_CT.shape[1] // spec.chunks_per_device
    tq, tk = tile_size(run, QUERY_TILE), tile_size(run, KEY_TILE)
    work = np.zeros(spec.size, np.int64)
    for i in range(spec.size):
        for j in range(spec.size):
            for q in np.split(positions_CT[i], len(positions_CT[i]) // tq):
                for k in np.split(positions_CT[j], len(positions_CT[j]) // tk):
                    if flash.any_visible(q[0], q[-1], k[0], k[-1], window):
                        work[i] += len(q) * len(k)
    return work
