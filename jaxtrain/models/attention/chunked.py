"""Causal attention in query chunks: skips fully masked key blocks, recomputes in backward.

The reference ('xla') builds the whole B·H·L·L score matrix, masks half of it and keeps the
probabilities for the backward pass; on CPU that is both twice the useful FLOPs and
hundreds of MB of fresh memory per layer. Here the queries are split into chunks of `block`
rows; chunk i only meets keys [0, end_i) (its causal prefix), so fully masked key blocks are
never computed, and only the diagonal block needs a mask. Each chunk's softmax is exact
(its whole prefix is one row), so no running rescaling is needed; a custom VJP keeps just
(out, logsumexp) and recomputes each chunk's probabilities in the backward pass.

With a sliding window of W, query position i sees keys (i - W, i]: chunk i then meets only
the keys from its first row's window start, so the work grows as L·W rather than L².

GQA: the R = H/G query heads sharing a kv head are folded into the query rows, so each chunk
is one batched matmul over (batch, kv group) and K/V are read once per group.

Document masks (segment ids, kernels.py): each chunk adds a second bias, −1e30
where the query's and the key's ids differ ([B, 1, rows, keys], from the chunk's query ids
and its key range's ids), in the forward pass and again where the backward pass recomputes
the probabilities. The key blocks skipped stay the causal ones: which blocks a document
boundary empties is data, and a static loop cannot skip them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models.attention.chunked_loop import attention as _looped_attention
from jaxtrain.models.attention.chunked_loop import key_block
from jaxtrain.models.attention.scaffold import (
    MASKED,
    causal_mask,
    fold_heads,
    from_groups,
    grouped,
    recomputing_vjp,
    same_document,
    to_groups,
    unfold_heads,
    ungrouped_grads,
)

# The unrolled kernel below serves sequences of up to this many query chunks (2048 tokens in
# 128-row chunks): each chunk is one large matmul against its whole key prefix, the fastest
# form on XLA:CPU (configs/bench_cpu.py). Beyond it the unrolled program grows with L²/block
# (at 32k: 256 chunks, their causal masks captured as ~8.6 GB of constants, and XLA keeps
# many chunks' score matrices alive at once), so longer sequences loop instead.
UNROLL_MAX_CHUNKS = 16


def _chunks(length: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, length)) for s in range(0, length, block)]


def _key_start(start: int, window: int | None) -> int:
    """The first key any query of a chunk starting at `start` can see."""
    return 0 if window is None else max(0, start - window + 1)


def _rows(x_BGRLK, start: int, end: int):
    """One query chunk with the R heads folded into rows: [B, G, R·C, K]."""
    return fold_heads(x_BGRLK[:, :, :, start:end])


def _scores(q_BGQK, k_BGMK, start: int, end: int, r: int, window: int | None, segments_BL):
    lo = _key_start(start, window)
    s_BGQM = jnp.einsum("bgqk,bgmk->bgqm", q_BGQK, k_BGMK[:, :, lo:end],
                        preferred_element_type=jnp.float32)
    s_BGQM = s_BGQM + _mask_bias(start, end, r, window)
    if segments_BL is not None:
        s_BGQM = s_BGQM + _segment_bias(segments_BL, start, end, lo, r)
    return s_BGQM


def _segment_bias(segments_BL, start: int, end: int, lo: int, repeats: int):
    """[B, 1, rows, keys]: 0 where query row j (position start + j % rows) and key lo + m
    are of one document, else −1e30 (rows as _rows folds them: heads outer)."""
    q_BQ = jnp.tile(segments_BL[:, start:end], (1, repeats))
    same_BQM = same_document(q_BQ, segments_BL[:, lo:end])
    return jnp.where(same_BQM, 0.0, MASKED).astype(jnp.float32)[:, None]


def _mask_bias(start: int, end: int, repeats: int, window: int | None) -> np.ndarray:
    """The causal mask as scores to add, [rows, keys] (rows: query row j at position
    start + j % rows; keys from _key_start), a numpy constant: an addition rather than a
    select is the cheaper pass over the scores on XLA:CPU (configs/bench_cpu.py: −0.8% step
    time), with the same numbers."""
    visible = causal_mask(np.tile(np.arange(start, end), repeats),
                          np.arange(_key_start(start, window), end), window)
    return np.where(visible, 0.0, MASKED).astype(np.float32)


def _forward(q_BLHK, k_BMGK, v_BMGK, segments_BL, block: int, window: int | None):
    r = q_BLHK.shape[2] // k_BMGK.shape[2]
    q_BGRLK, k_BGMK, v_BGMK = grouped(q_BLHK, k_BMGK, v_BMGK)
    outs, lses = [], []
    for start, end in _chunks(q_BLHK.shape[1], block):
        lo = _key_start(start, window)
        s_BGQM = _scores(_rows(q_BGRLK, start, end), k_BGMK, start, end, r, window,
                         segments_BL)
        max_BGQ = s_BGQM.max(-1, keepdims=True)
        p_BGQM = jnp.exp(s_BGQM - max_BGQ)
        sum_BGQ = p_BGQM.sum(-1, keepdims=True)
        o_BGQK = jnp.einsum("bgqm,bgmk->bgqk", p_BGQM.astype(v_BGMK.dtype), v_BGMK[:, :, lo:end],
                            preferred_element_type=jnp.float32) / sum_BGQ
        outs.append(unfold_heads(o_BGQK.astype(q_BLHK.dtype), r))
        lses.append(unfold_heads((max_BGQ + jnp.log(sum_BGQ))[..., 0], r))
    return from_groups(jnp.concatenate(outs, axis=3)), jnp.concatenate(lses, axis=3)


def _transposed_matmul(a_BGNX, b_BGNY):
    """aᵀb contracted over the rows N, [B, G, X, Y] float32, with aᵀ materialised first: as a
    plain row-major batched matmul XLA:CPU runs it about twice as fast as contracting the
    rows in place (measured at the bench_cpu shapes)."""
    a_BGXN = jax.lax.optimization_barrier(jnp.swapaxes(a_BGNX, -1, -2))
    return jnp.matmul(a_BGXN, b_BGNY, preferred_element_type=jnp.float32)


def _backward(block, window, residuals, dout_BLHK):
    q_BLHK, k_BMGK, v_BMGK, segments_BL, out_BLHK, lse_BGRL = residuals
    b, length, heads, _ = q_BLHK.shape
    groups = k_BMGK.shape[2]
    r = heads // groups
    q_BGRLK, k_BGMK, v_BGMK = grouped(q_BLHK, k_BMGK, v_BMGK)
    do_BGRLK = to_groups(dout_BLHK, groups)
    # delta = rowsum(dO ∘ O) = rowsum(P ∘ dP): the softmax backward's per-row correction.
    # 16-bit products are exact in float32, so float32 accumulation alone keeps it exact.
    delta_BLH = jnp.einsum("blhk,blhk->blh", dout_BLHK, out_BLHK,
                           preferred_element_type=jnp.float32)
    delta_BGRL = to_groups(delta_BLH, groups)
    dk_BGMK = jnp.zeros(k_BGMK.shape, jnp.float32)
    dv_BGMK = jnp.zeros(v_BGMK.shape, jnp.float32)
    dqs = []
    # Keys as rows (Pᵀ, dSᵀ: [keys, queries]): dK = dSᵀQ and dV = PᵀdO are then plain
    # row-major matmuls, and only dSᵀ is transposed, once, for dQ = dS·K (with queries as
    # rows, P and dS both had to be: configs/bench_cpu.py −1.2% step time).
    for start, end in _chunks(length, block):
        q_BGQK, do_BGQK = _rows(q_BGRLK, start, end), _rows(do_BGRLK, start, end)
        rows = q_BGQK.shape[2]
        lse_BG1Q = lse_BGRL[:, :, :, start:end].reshape(b, groups, 1, rows)
        delta_BG1Q = delta_BGRL[:, :, :, start:end].reshape(b, groups, 1, rows)
        lo = _key_start(start, window)
        k_chunk_BGMK, v_chunk_BGMK = k_BGMK[:, :, lo:end], v_BGMK[:, :, lo:end]
        sT_BGMQ = jnp.einsum("bgmk,bgqk->bgmq", k_chunk_BGMK, q_BGQK,
                             preferred_element_type=jnp.float32)
        sT_BGMQ = sT_BGMQ + _mask_bias(start, end, r, window).T
        if segments_BL is not None:
            sT_BGMQ = sT_BGMQ + jnp.swapaxes(_segment_bias(segments_BL, start, end, lo, r),
                                             -1, -2)
        pT_BGMQ = jnp.exp(sT_BGMQ - lse_BG1Q)
        dpT_BGMQ = jnp.einsum("bgmk,bgqk->bgmq", v_chunk_BGMK, do_BGQK,
                              preferred_element_type=jnp.float32)
        dsT_BGMQ = pT_BGMQ * (dpT_BGMQ - delta_BG1Q)
        # P and dS in the compute dtype for their matmuls (16-bit tensor cores), as flash
        # kernels do; the products still accumulate in float32. A no-op under float32.
        pT_BGMQ, dsT_BGMQ = pT_BGMQ.astype(q_BLHK.dtype), dsT_BGMQ.astype(q_BLHK.dtype)
        dv_BGMK = dv_BGMK.at[:, :, lo:end].add(
            jnp.matmul(pT_BGMQ, do_BGQK, preferred_element_type=jnp.float32))
        dk_BGMK = dk_BGMK.at[:, :, lo:end].add(
            jnp.matmul(dsT_BGMQ, q_BGQK, preferred_element_type=jnp.float32))
        dqs.append(unfold_heads(_transposed_matmul(dsT_BGMQ, k_chunk_BGMK), r))
    return ungrouped_grads(jnp.concatenate(dqs, axis=3), dk_BGMK, dv_BGMK,
                           q_BLHK, k_BMGK, v_BMGK)


_attention = recomputing_vjp(_forward, _backward, statics=2)  # (block, window)


def chunked_attention(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array,
                      window: int | None = None, segments_BL=None,
                      block: int = 128, sinks=None) -> jax.Array:
    """Causal GQA attention, same contract as attention.xla_attention (q already scaled;
    sinks: [H] attention-sink logits, scaffold.with_sinks). Up to UNROLL_MAX_CHUNKS query
    chunks the loop is unrolled (above); longer sequences go through the looped kernel
    (chunked_loop.py), whose memory and compile time do not grow with the number of
    chunks."""
    if looped(q_BLHK.shape[1], block):
        return _looped_attention(q_BLHK, k_BMGK, v_BMGK, segments_BL, sinks, block, window)
    return _attention(q_BLHK, k_BMGK, v_BMGK, segments_BL, sinks, block, window)


def looped(length: int, block: int) -> bool:
    """Whether a sequence of `length` goes through the looped kernel: more query chunks than
    UNROLL_MAX_CHUNKS, and whole chunks (the loop slices fixed-size blocks)."""
    return length % block == 0 and length // block > UNROLL_MAX_CHUNKS


def loop_tile(length: int, block: int) -> int:
    """Key columns of the [query chunk, key block] tile the looped kernel forms for a
    sequence of `length` (0: the unrolled kernel runs it): the planner's fact."""
    return key_block(length, block) if looped(length, block) else 0
