"""The chunked kernel for long sequences: query chunks and key blocks visited in loops.

chunked_attention.py unrolls one Python iteration per query chunk, each a matmul against the
chunk's whole key prefix. That is the fastest form for a few chunks, but the program, its
constant masks and the score buffers XLA keeps alive grow with the number of chunks. Here a
`lax.scan` runs over the query chunks and, inside it, a `lax.fori_loop` over key blocks of
`key_block` positions, from the first block the chunk's window reaches to the block holding
its last query (the bounds depend on the chunk index: causally empty blocks are never
visited). Each step folds one [query chunk, key block] score tile into an online softmax
(running max m, denominator l, unnormalised output o, all float32), so the largest array the
kernel makes is one tile, whatever the length, and the program is the same size at 4k and
128k. The masks come from positions (iota), never from constants.

Backward (custom VJP, residuals q, k, v, out and the logsumexp): the same loops; each tile's
probabilities are recomputed from the logsumexp, dQ is accumulated per query chunk and dK/dV
in float32 buffers of the whole keys, updated a block at a time in place.

A key block is a whole number of query chunks, so a chunk never straddles two key blocks and
the last block visited holds every query's own position: every row sees at least one key
there, which keeps the softmax finite whatever the document masks hide.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.attention import flash
from jaxtrain.models.attention.scaffold import (
    fold_heads,
    from_chunks,
    grouped,
    recomputing_vjp,
    to_groups,
    ungrouped_grads,
)


def key_block(length: int, block: int) -> int:
    """Key positions per loop step: 4 query chunks where the length allows (larger matmuls,
    fewer steps), else 2, else 1."""
    return next(block * m for m in (4, 2, 1) if length % (block * m) == 0)


class _Chunk:
    """Query chunk i (a traced index), heads folded into its rows, and the key blocks it
    meets: [lo, hi), from the first its window reaches to the one holding its last query."""

    def __init__(self, i, x_BGRLK, segments_BL, block: int, kblock: int, window):
        r = x_BGRLK.shape[2]
        start = i * block
        self.kblock, self.window, self.segments_BL = kblock, window, segments_BL
        self.rows = fold_heads(jax.lax.dynamic_slice_in_dim(x_BGRLK, start, block, 3))
        self.pos_Q = start + jnp.tile(jnp.arange(block), r)
        self.ids_BQ = None if segments_BL is None else jnp.tile(
            jax.lax.dynamic_slice_in_dim(segments_BL, start, block, 1), (1, r))
        self.lo = 0 if window is None else jnp.maximum(start - window + 1, 0) // kblock
        self.hi = (start + block - 1) // kblock + 1

    def of(self, x_BGRLK, i, block: int):
        """Another [B, G, R, L, ...] array's rows of this chunk (dO, logsumexp, delta)."""
        return fold_heads(jax.lax.dynamic_slice_in_dim(x_BGRLK, i * block, block, 3))

    def seen(self, j):
        key_M = j * self.kblock + jnp.arange(self.kblock)
        ids_BM = None if self.segments_BL is None else jax.lax.dynamic_slice_in_dim(
            self.segments_BL, j * self.kblock, self.kblock, 1)
        return flash.visible(self.pos_Q, key_M, self.window, self.ids_BQ, ids_BM)


def _keys(x_BGMK, j, kblock: int):
    return jax.lax.dynamic_slice_in_dim(x_BGMK, j * kblock, kblock, 2)


def _forward(q_BLHK, k_BMGK, v_BMGK, segments_BL, block: int, window):
    b, length, heads, _ = q_BLHK.shape
    kblock, groups = key_block(length, block), k_BMGK.shape[2]
    q_BGRLK, k_BGMK, v_BGMK = grouped(q_BLHK, k_BMGK, v_BMGK)
    r = heads // groups

    def one_chunk(i):
        chunk = _Chunk(i, q_BGRLK, segments_BL, block, kblock, window)

        def step(j, acc):
            return flash.fold(acc, chunk.rows, _keys(k_BGMK, j, kblock),
                              _keys(v_BGMK, j, kblock), chunk.seen(j))

        acc = jax.lax.fori_loop(chunk.lo, chunk.hi, step,
                                flash.empty(b, groups, r * block, v_BMGK.shape[-1]))
        out_BGQK, lse_BGQ = flash.finish(acc)
        return out_BGQK.astype(q_BLHK.dtype), lse_BGQ

    out_NBGQK, lse_NBGQ = jax.lax.map(one_chunk, jnp.arange(length // block))
    return from_chunks(out_NBGQK, r), to_groups(from_chunks(lse_NBGQ, r), groups)


def _backward(block, window, residuals, dout_BLHK):
    q_BLHK, k_BMGK, v_BMGK, segments_BL, out_BLHK, lse_BGRL = residuals
    length, heads = q_BLHK.shape[1:3]
    kblock, groups = key_block(length, block), k_BMGK.shape[2]
    r = heads // groups
    q_BGRLK, k_BGMK, v_BGMK = grouped(q_BLHK, k_BMGK, v_BMGK)
    do_BGRLK = to_groups(dout_BLHK, groups)
    # 16-bit products are exact in float32: float32 accumulation keeps delta exact.
    delta_BGRL = jnp.einsum("bgrlk,bgrlk->bgrl", do_BGRLK, to_groups(out_BLHK, groups),
                            preferred_element_type=jnp.float32)

    def one_chunk(carry, i):
        chunk = _Chunk(i, q_BGRLK, segments_BL, block, kblock, window)
        do_BGQK = chunk.of(do_BGRLK, i, block)
        lse_BGQ, delta_BGQ = chunk.of(lse_BGRL, i, block), chunk.of(delta_BGRL, i, block)

        def step(j, acc):
            dq_BGQK, dk_BGMK, dv_BGMK = acc
            dq, dk, dv = flash.tile_grads(chunk.rows, do_BGQK, lse_BGQ, delta_BGQ,
                                          _keys(k_BGMK, j, kblock), _keys(v_BGMK, j, kblock),
                                          chunk.seen(j))
            return (dq_BGQK + dq, _add_block(dk_BGMK, dk, j, kblock),
                    _add_block(dv_BGMK, dv, j, kblock))

        dq0 = jnp.zeros(chunk.rows.shape, jnp.float32)
        dq_BGQK, *carry = jax.lax.fori_loop(chunk.lo, chunk.hi, step, (dq0, *carry))
        return tuple(carry), dq_BGQK

    zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (k_BGMK, v_BGMK))  # (MLA: v's dim)
    (dk_BGMK, dv_BGMK), dq_NBGQK = jax.lax.scan(one_chunk, zeros,
                                                jnp.arange(length // block))
    return ungrouped_grads(to_groups(from_chunks(dq_NBGQK, r), groups), dk_BGMK, dv_BGMK,
                           q_BLHK, k_BMGK, v_BMGK)


def _add_block(x_BGMK, update_BGMK, j, kblock: int):
    """x with `update` added to key block j, in place."""
    start = j * kblock
    old = jax.lax.dynamic_slice_in_dim(x_BGMK, start, kblock, 2)
    return jax.lax.dynamic_update_slice_in_dim(x_BGMK, old + update_BGMK, start, 2)


# Causal GQA attention (q already scaled), the contract of chunked_attention; statics
# (block, window).
attention = recomputing_vjp(_forward, _backward, statics=2)
