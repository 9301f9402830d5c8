"""What every attention kernel of this package builds on, written once: the grouped layout,
head folding, masks and the recomputing custom VJP.

Layout. Kernels take q [B, L, H, K] and k, v [B, M, G, K] (models/attention/kernels.py).
Inside, the R = H/G query heads that share a kv head are grouped under it, q as
[B, G, R, L, K] and k, v as [B, G, M, K], so each (example, kv head) is one batch of
matmuls and K/V are read once per group. A tile of t query positions folds its R heads into
its rows, heads outer: [B, G, R·t, K], row j the query at position j % t.

Masks come from positions (causal, sliding window) and segment ids (documents); a masked
score is MASKED, or MASKED is added to it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Added to masked scores: exp(MASKED - max) is exactly 0, and unlike finfo.min it cannot
# overflow to -inf when a score is added to it.
MASKED = -1e30


def causal_mask(q_pos_Q, k_pos_M, window: int | None):
    """Bool [Q, M]: which keys each query sees (causal, within the window: keys
    (p - window, p] for a query at p). numpy positions give a numpy constant, traced ones
    an array."""
    visible_QM = k_pos_M[None, :] <= q_pos_Q[:, None]
    if window is not None:
        visible_QM &= k_pos_M[None, :] > q_pos_Q[:, None] - window
    return visible_QM


def same_document(q_ids_BQ, k_ids_BM):
    """Bool [B, Q, M]: whether each query and key are of one document."""
    return q_ids_BQ[:, :, None] == k_ids_BM[:, None, :]


def to_groups(x_BLH, groups: int):
    """[B, L, H, ...] -> [B, G, R, L, ...]: query heads under their kv head."""
    b, length, heads = x_BLH.shape[:3]
    x = x_BLH.reshape(b, length, groups, heads // groups, *x_BLH.shape[3:])
    return jnp.moveaxis(x, 1, 3)


def from_groups(x_BGRL):
    """[B, G, R, L, ...] -> [B, L, H, ...]."""
    b, g, r, length = x_BGRL.shape[:4]
    return jnp.moveaxis(x_BGRL, 3, 1).reshape(b, length, g * r, *x_BGRL.shape[4:])


def swap_length_and_groups(x_BMGK):
    """[B, M, G, K] <-> [B, G, M, K]: keys and values in the grouped layout, and back."""
    return x_BMGK.transpose(0, 2, 1, 3)


def grouped(q_BLHK, k_BMGK, v_BMGK):
    """(q [B, G, R, L, K], k and v [B, G, M, K]): a kernel's inputs in the grouped layout."""
    return (to_groups(q_BLHK, k_BMGK.shape[2]), swap_length_and_groups(k_BMGK),
            swap_length_and_groups(v_BMGK))


def ungrouped_grads(dq_BGRLK, dk_BGMK, dv_BGMK, q_BLHK, k_BMGK, v_BMGK):
    """Float32 gradients in the grouped layout -> the inputs' layouts and dtypes."""
    return (from_groups(dq_BGRLK).astype(q_BLHK.dtype),
            swap_length_and_groups(dk_BGMK).astype(k_BMGK.dtype),
            swap_length_and_groups(dv_BGMK).astype(v_BMGK.dtype))


def fold_heads(x_BGRT):
    """[B, G, R, t, ...] -> [B, G, R·t, ...] (heads outer)."""
    b, g, r, t = x_BGRT.shape[:4]
    return x_BGRT.reshape(b, g, r * t, *x_BGRT.shape[4:])


def unfold_heads(x_BGQ, r: int):
    """[B, G, R·t, ...] -> [B, G, R, t, ...]."""
    b, g, rows = x_BGQ.shape[:3]
    return x_BGQ.reshape(b, g, r, rows // r, *x_BGQ.shape[3:])


def from_chunks(x_NBGQ, r: int):
    """N query chunks of folded rows [N, B, G, R·C, ...] -> [B, L = N·C, H, ...]."""
    n, b, g, rows = x_NBGQ.shape[:4]
    rest = x_NBGQ.shape[4:]
    x = x_NBGQ.reshape(n, b, g, r, rows // r, *rest)
    x = x.transpose(1, 0, 4, 2, 3, *range(5, 5 + len(rest)))  # [B, N, C, G, R, ...]
    return x.reshape(b, n * (rows // r), g * r, *rest)


def recomputing_vjp(forward, backward, statics: int):
    """attention(q, k, v, segments, sinks, *statics) -> out, with the custom VJP every kernel
    here shares: forward(q, k, v, segments, *statics) -> (out, logsumexp [B, G, R, L]); the
    residuals are the inputs, the output and its logsumexp, and backward(*statics,
    residuals, dout) -> (dq, dk, dv) recomputes the probabilities from them (autodiff would
    keep every score tile). The statics (block sizes, window, layout) are hashable and not
    differentiated. sinks: None, or [H] learned logits (with_sinks)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=tuple(range(5, 5 + statics)))
    def attention(q_BLHK, k_BMGK, v_BMGK, segments_BL, sinks_H, *static):
        return attention_fwd(q_BLHK, k_BMGK, v_BMGK, segments_BL, sinks_H, *static)[0]

    def attention_fwd(q_BLHK, k_BMGK, v_BMGK, segments_BL, sinks_H, *static):
        out_BLHK, lse_BGRL = forward(q_BLHK, k_BMGK, v_BMGK, segments_BL, *static)
        if sinks_H is not None:
            out_BLHK, lse_BGRL = with_sinks(out_BLHK, lse_BGRL, sinks_H)
        return out_BLHK, (q_BLHK, k_BMGK, v_BMGK, segments_BL, sinks_H, out_BLHK, lse_BGRL)

    def attention_bwd(*args):
        *static, residuals, dout_BLHK = args
        q_BLHK, k_BMGK, v_BMGK, segments_BL, sinks_H, out_BLHK, lse_BGRL = residuals
        grads = backward(*static, (q_BLHK, k_BMGK, v_BMGK, segments_BL, out_BLHK, lse_BGRL),
                         dout_BLHK)
        dsinks_H = None if sinks_H is None else sink_grads(sinks_H, out_BLHK, lse_BGRL,
                                                           dout_BLHK)
        return (*grads, None, dsinks_H)  # None: the segment ids

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


def _sinks_GR1(sinks_H, groups: int):
    return sinks_H.astype(jnp.float32).reshape(groups, -1)[None, :, :, None]


def with_sinks(out_BLHK, lse_BGRL, sinks_H):
    """(out, logsumexp) of a softmax with one more column per query, the head's sink logit,
    whose probability is dropped (gpt-oss's attention sinks): the logsumexp takes the sink
    in, and the output shrinks by the share the sink took, exp(lse − lse'). The backward
    pass is the kernel's own from these two: probabilities recomputed from lse' are the
    sink softmax's, and rowsum(dO ∘ O') is still rowsum(P ∘ dP) over the keys, the sink
    column having no value (so dP = 0 there)."""
    sunk_BGRL = jnp.logaddexp(lse_BGRL, _sinks_GR1(sinks_H, lse_BGRL.shape[1]))
    kept_BLH = from_groups(jnp.exp(lse_BGRL - sunk_BGRL))
    out_BLHK = (out_BLHK.astype(jnp.float32) * kept_BLH[..., None]).astype(out_BLHK.dtype)
    return out_BLHK, sunk_BGRL


def sink_grads(sinks_H, out_BLHK, lse_BGRL, dout_BLHK):
    """d loss / d sink: its column's probability times (0 − rowsum(dO ∘ O)), summed over
    the head's rows (the softmax backward, the sink's value being nothing)."""
    groups = lse_BGRL.shape[1]
    delta_BGRL = to_groups(jnp.einsum("blhk,blhk->blh", dout_BLHK, out_BLHK,
                                      preferred_element_type=jnp.float32), groups)
    p_BGRL = jnp.exp(_sinks_GR1(sinks_H, groups) - lse_BGRL)
    return -(p_BGRL * delta_BGRL).sum(axis=(0, 3)).reshape(-1).astype(sinks_H.dtype)
