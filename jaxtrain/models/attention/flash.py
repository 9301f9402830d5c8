"""Flash-attention tile math shared by the looped kernels (chunked_loop.py for one device,
context.py across the `context` axis): one [query rows, key block] score tile at a time, an
online softmax forward and a backward that recomputes the tile's probabilities from the
saved logsumexp.

Layout (scaffold.py): the R query heads that share a kv head are folded into the rows,
heads outer: q and dO are [B, G, Q = R·t, K] for t query positions, k and v [B, G, M, K];
row j is the query at position `q_pos[j % t]`, so positions and segment ids come tiled R
times. Masks come from positions (causal, sliding window) and segment ids (documents): no
constant masks, whatever the length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.attention.scaffold import MASKED, causal_mask, same_document


def visible(q_pos_Q, k_pos_M, window, q_ids_BQ=None, k_ids_BM=None):
    """Bool [B or 1, 1, Q, M]: which keys each row sees (causal, within the window, of its
    own document)."""
    seen = causal_mask(q_pos_Q, k_pos_M, window)[None, None]
    if q_ids_BQ is not None:
        seen = seen & same_document(q_ids_BQ, k_ids_BM)[:, None]
    return seen


def any_visible(q_first, q_last, k_first, k_last, window):
    """Whether a run of ascending contiguous query positions sees any key of such a run."""
    seen = k_first <= q_last
    if window is not None:
        seen &= k_last > q_first - window
    return seen


def empty(b: int, g: int, rows: int, head_dim: int):
    """The online softmax's state before any key: (o, m, l), float32."""
    return (jnp.zeros((b, g, rows, head_dim), jnp.float32),
            jnp.full((b, g, rows), MASKED, jnp.float32), jnp.zeros((b, g, rows), jnp.float32))


def fold(acc, q_BGQK, k_BGMK, v_BGMK, seen):
    """acc with one key block folded in (masked keys contribute exactly nothing)."""
    o_BGQK, m_BGQ, l_BGQ = acc
    s_BGQM = jnp.einsum("bgqk,bgmk->bgqm", q_BGQK, k_BGMK, preferred_element_type=jnp.float32)
    # The output does not depend on the running max, only its float range does.
    m_new = jax.lax.stop_gradient(jnp.maximum(m_BGQ, jnp.where(seen, s_BGQM, MASKED).max(-1)))
    p_BGQM = jnp.where(seen, jnp.exp(s_BGQM - m_new[..., None]), 0.0)
    scale = jnp.exp(m_BGQ - m_new)
    pv_BGQK = jnp.einsum("bgqm,bgmk->bgqk", p_BGQM.astype(v_BGMK.dtype), v_BGMK,
                         preferred_element_type=jnp.float32)
    return o_BGQK * scale[..., None] + pv_BGQK, m_new, l_BGQ * scale + p_BGQM.sum(-1)


def finish(acc):
    """(output float32, logsumexp) of a finished state; every row must have seen a key."""
    o_BGQK, m_BGQ, l_BGQ = acc
    return o_BGQK / l_BGQ[..., None], m_BGQ + jnp.log(l_BGQ)


def tile_grads(q_BGQK, do_BGQK, lse_BGQ, delta_BGQ, k_BGMK, v_BGMK, seen):
    """One tile's float32 shares of dQ, dK and dV. delta = rowsum(dO ∘ O). Keys are the
    rows of the recomputed probabilities ([keys, queries]): dK = dSᵀQ and dV = PᵀdO are
    then plain row-major matmuls, and only dSᵀ is contracted over its rows (for dQ).
    Every matmul takes operands of q's dtype (P and dS cast to it, as flash kernels do:
    16-bit tensor cores) and accumulates in float32; under float32 the casts are no-ops."""
    f32, dt = jnp.float32, q_BGQK.dtype
    do_BGQK = do_BGQK.astype(dt)
    seen_MQ = jnp.swapaxes(seen, -1, -2)
    sT_BGMQ = jnp.einsum("bgmk,bgqk->bgmq", k_BGMK, q_BGQK, preferred_element_type=f32)
    pT_BGMQ = jnp.where(seen_MQ, jnp.exp(sT_BGMQ - lse_BGQ[:, :, None]), 0.0)
    dpT_BGMQ = jnp.einsum("bgmk,bgqk->bgmq", v_BGMK, do_BGQK, preferred_element_type=f32)
    dsT_BGMQ = (pT_BGMQ * (dpT_BGMQ - delta_BGQ[:, :, None])).astype(dt)
    dv_BGMK = jnp.matmul(pT_BGMQ.astype(dt), do_BGQK, preferred_element_type=f32)
    dk_BGMK = jnp.matmul(dsT_BGMQ, q_BGQK, preferred_element_type=f32)
    dq_BGQK = jnp.einsum("bgmq,bgmk->bgqk", dsT_BGMQ, k_BGMK, preferred_element_type=f32)
    return dq_BGQK, dk_BGMK, dv_BGMK


def tile_flops(q_BGQK, k_BGMK) -> int:
    """Matmul FLOPs of one tile's forward (QKᵀ and PV)."""
    b, g, rows, head_dim = q_BGQK.shape
    return 4 * b * g * rows * k_BGMK.shape[2] * head_dim
