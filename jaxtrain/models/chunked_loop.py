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

import functools

import jax
import jax.numpy as jnp

_MASKED = -1e30  # as in chunked_attention


def key_block(length: int, block: int) -> int:
    """Key positions per loop step: 4 query chunks where the length allows (larger matmuls,
    fewer steps), else 2, else 1."""
    return next(block * m for m in (4, 2, 1) if length % (block * m) == 0)


def _grouped(q_BLHK, k_BMGK, v_BMGK):
    """q as [B, G, R, L, K] (query heads under their kv head), k and v as [B, G, M, K]."""
    b, length, heads, head_dim = q_BLHK.shape
    groups = k_BMGK.shape[2]
    q_BGRLK = q_BLHK.reshape(b, length, groups, heads // groups, head_dim).transpose(
        0, 2, 3, 1, 4)
    return q_BGRLK, k_BMGK.transpose(0, 2, 1, 3), v_BMGK.transpose(0, 2, 1, 3)


class _Chunk:
    """Query chunk i (a traced index) with its R heads folded into rows: rows = R·C."""

    def __init__(self, i, q_BGRLK, segments_BL, block: int, kblock: int, window):
        b, g, r, _, k = q_BGRLK.shape
        self.start = i * block
        self.block, self.kblock, self.window = block, kblock, window
        self.q = jax.lax.dynamic_slice_in_dim(q_BGRLK, self.start, block, 3).reshape(
            b, g, r * block, k)
        # Row j of the folded chunk is query position start + j % C (heads outer).
        self.pos_Q = self.start + jnp.tile(jnp.arange(block), r)
        self.ids_BQ = None if segments_BL is None else jnp.tile(
            jax.lax.dynamic_slice_in_dim(segments_BL, self.start, block, 1), (1, r))
        self.segments_BL = segments_BL
        first = self.start if window is None else self.start - window + 1
        self.lo = jnp.maximum(first, 0) // kblock if window is not None else 0
        self.hi = (self.start + block - 1) // kblock + 1

    def visible(self, j):
        """Bool [B or 1, 1, rows, key_block]: which keys of block j each row sees."""
        key_M = j * self.kblock + jnp.arange(self.kblock)
        seen_QM = key_M[None, :] <= self.pos_Q[:, None]
        if self.window is not None:
            seen_QM &= key_M[None, :] > self.pos_Q[:, None] - self.window
        seen = seen_QM[None, None]
        if self.ids_BQ is not None:
            ids_BM = jax.lax.dynamic_slice_in_dim(self.segments_BL, j * self.kblock,
                                                  self.kblock, 1)
            seen = seen & (self.ids_BQ[:, :, None] == ids_BM[:, None, :])[:, None]
        return seen


def _keys(x_BGMK, j, kblock: int):
    return jax.lax.dynamic_slice_in_dim(x_BGMK, j * kblock, kblock, 2)


def _forward(q_BLHK, k_BMGK, v_BMGK, segments_BL, block: int, window):
    b, length, heads, head_dim = q_BLHK.shape
    kblock = key_block(length, block)
    q_BGRLK, k_BGMK, v_BGMK = _grouped(q_BLHK, k_BMGK, v_BMGK)
    g, r = q_BGRLK.shape[1:3]

    def one_chunk(i):
        chunk = _Chunk(i, q_BGRLK, segments_BL, block, kblock, window)

        def step(j, acc):
            o_BGQK, m_BGQ, l_BGQ = acc
            seen = chunk.visible(j)
            s_BGQM = jnp.einsum("bgqk,bgmk->bgqm", chunk.q, _keys(k_BGMK, j, kblock),
                                preferred_element_type=jnp.float32)
            m_new = jnp.maximum(m_BGQ, jnp.where(seen, s_BGQM, _MASKED).max(-1))
            p_BGQM = jnp.where(seen, jnp.exp(s_BGQM - m_new[..., None]), 0.0)
            scale = jnp.exp(m_BGQ - m_new)
            pv_BGQK = jnp.einsum("bgqm,bgmk->bgqk", p_BGQM.astype(v_BGMK.dtype),
                                 _keys(v_BGMK, j, kblock), preferred_element_type=jnp.float32)
            return o_BGQK * scale[..., None] + pv_BGQK, m_new, l_BGQ * scale + p_BGQM.sum(-1)

        rows = r * block
        init = (jnp.zeros((b, g, rows, head_dim), jnp.float32),
                jnp.full((b, g, rows), _MASKED, jnp.float32), jnp.zeros((b, g, rows), jnp.float32))
        o_BGQK, m_BGQ, l_BGQ = jax.lax.fori_loop(chunk.lo, chunk.hi, step, init)
        return (o_BGQK / l_BGQ[..., None]).astype(q_BLHK.dtype), m_BGQ + jnp.log(l_BGQ)

    # [N, B, G, R·C, ...] -> [B, L, H, K] and the logsumexp as [B, G, R, L].
    out_NBGQK, lse_NBGQ = jax.lax.map(one_chunk, jnp.arange(length // block))
    n = length // block
    out_BLHK = out_NBGQK.reshape(n, b, g, r, block, head_dim).transpose(1, 0, 4, 2, 3, 5) \
        .reshape(b, length, heads, head_dim)
    lse_BGRL = lse_NBGQ.reshape(n, b, g, r, block).transpose(1, 2, 3, 0, 4).reshape(
        b, g, r, length)
    return out_BLHK, lse_BGRL


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention(q_BLHK, k_BMGK, v_BMGK, segments_BL, block, window):
    """Causal GQA attention (q already scaled), the contract of chunked_attention."""
    return _forward(q_BLHK, k_BMGK, v_BMGK, segments_BL, block, window)[0]


def _attention_fwd(q_BLHK, k_BMGK, v_BMGK, segments_BL, block, window):
    out_BLHK, lse_BGRL = _forward(q_BLHK, k_BMGK, v_BMGK, segments_BL, block, window)
    return out_BLHK, (q_BLHK, k_BMGK, v_BMGK, segments_BL, out_BLHK, lse_BGRL)


def _attention_bwd(block, window, residuals, dout_BLHK):
    q_BLHK, k_BMGK, v_BMGK, segments_BL, out_BLHK, lse_BGRL = residuals
    b, length, heads, head_dim = q_BLHK.shape
    kblock = key_block(length, block)
    q_BGRLK, k_BGMK, v_BGMK = _grouped(q_BLHK, k_BMGK, v_BMGK)
    do_BGRLK = _grouped(dout_BLHK, k_BMGK, v_BMGK)[0]
    g, r = q_BGRLK.shape[1:3]
    # delta = rowsum(dO ∘ O): the softmax backward's per-row correction.
    delta_BGRL = jnp.einsum("bgrlk,bgrlk->bgrl", do_BGRLK.astype(jnp.float32),
                            _grouped(out_BLHK, k_BMGK, v_BMGK)[0].astype(jnp.float32))

    def rows_of(x_BGRL, i):
        return jax.lax.dynamic_slice_in_dim(x_BGRL, i * block, block, 3).reshape(
            b, g, 1, r * block)

    def one_chunk(carry, i):
        chunk = _Chunk(i, q_BGRLK, segments_BL, block, kblock, window)
        do_BGQK = _Chunk(i, do_BGRLK, None, block, kblock, window).q
        lse_BG1Q, delta_BG1Q = rows_of(lse_BGRL, i), rows_of(delta_BGRL, i)

        def step(j, acc):
            dq_BGQK, dk_BGMK, dv_BGMK = acc
            k_blk, v_blk = _keys(k_BGMK, j, kblock), _keys(v_BGMK, j, kblock)
            # Keys as rows ([keys, queries]), as the unrolled backward: dK and dV are then
            # plain row-major matmuls.
            seen_MQ = jnp.swapaxes(chunk.visible(j), -1, -2)
            sT_BGMQ = jnp.einsum("bgmk,bgqk->bgmq", k_blk, chunk.q,
                                 preferred_element_type=jnp.float32)
            pT_BGMQ = jnp.where(seen_MQ, jnp.exp(sT_BGMQ - lse_BG1Q), 0.0)
            dpT_BGMQ = jnp.einsum("bgmk,bgqk->bgmq", v_blk, do_BGQK,
                                  preferred_element_type=jnp.float32)
            dsT_BGMQ = pT_BGMQ * (dpT_BGMQ - delta_BG1Q)
            dv_blk = jnp.matmul(pT_BGMQ, do_BGQK.astype(jnp.float32))
            dk_blk = jnp.matmul(dsT_BGMQ, chunk.q.astype(jnp.float32))
            dq_BGQK += jnp.einsum("bgmq,bgmk->bgqk", dsT_BGMQ, k_blk.astype(jnp.float32))
            return (dq_BGQK, _add_block(dk_BGMK, dk_blk, j, kblock),
                    _add_block(dv_BGMK, dv_blk, j, kblock))

        dq0 = jnp.zeros(chunk.q.shape, jnp.float32)
        dq_BGQK, dk_BGMK, dv_BGMK = jax.lax.fori_loop(chunk.lo, chunk.hi, step, (dq0, *carry))
        return (dk_BGMK, dv_BGMK), dq_BGQK

    zeros = jnp.zeros(k_BGMK.shape, jnp.float32)
    n = length // block
    (dk_BGMK, dv_BGMK), dq_NBGQK = jax.lax.scan(one_chunk, (zeros, zeros), jnp.arange(n))
    dq_BLHK = dq_NBGQK.reshape(n, b, g, r, block, head_dim).transpose(1, 0, 4, 2, 3, 5) \
        .reshape(b, length, heads, head_dim)
    return (dq_BLHK.astype(q_BLHK.dtype), dk_BGMK.transpose(0, 2, 1, 3).astype(k_BMGK.dtype),
            dv_BGMK.transpose(0, 2, 1, 3).astype(v_BMGK.dtype), None)


def _add_block(x_BGMK, update_BGMK, j, kblock: int):
    """x with `update` added to key block j, in place."""
    start = j * kblock
    old = jax.lax.dynamic_slice_in_dim(x_BGMK, start, kblock, 2)
    return jax.lax.dynamic_update_slice_in_dim(x_BGMK, old + update_BGMK, start, 2)


attention.defvjp(_attention_fwd, _attention_bwd)
