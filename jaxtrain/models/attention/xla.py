"""The reference kernel ('xla'): the whole score matrix, masked, float32 softmax; and the
same over a kv cache (decoding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.attention import cache as decode_cache
from jaxtrain.models.attention.scaffold import causal_mask, same_document


def _scores(q_BTGRK, k_BMGK):
    """QKᵀ [B, G, R, T, M], float32. In 16 bits its backward casts dS to the compute dtype
    before the dQ and dK matmuls, as flash kernels do: autodiff would upcast K and Q to meet
    the float32 dS instead, f32×f32 matmuls off a GPU's 16-bit tensor cores. Under float32
    autodiff's own backward stays (the step compiles exactly as before)."""
    if q_BTGRK.dtype == jnp.float32:
        return _qk(q_BTGRK, k_BMGK)
    return _qk_16bit(q_BTGRK, k_BMGK)


def _qk(q_BTGRK, k_BMGK):
    return jnp.einsum("btgrk,bmgk->bgrtm", q_BTGRK, k_BMGK, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _qk_16bit(q_BTGRK, k_BMGK):
    return _qk(q_BTGRK, k_BMGK)


def _qk_16bit_fwd(q_BTGRK, k_BMGK):
    return _qk(q_BTGRK, k_BMGK), (q_BTGRK, k_BMGK)


def _qk_16bit_bwd(residuals, ds_BGRTM):
    """dQ and dK from dS in the compute dtype, accumulated in float32."""
    q_BTGRK, k_BMGK = residuals
    ds_BGRTM = ds_BGRTM.astype(q_BTGRK.dtype)
    dq = jnp.einsum("bgrtm,bmgk->btgrk", ds_BGRTM, k_BMGK, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bgrtm,btgrk->bmgk", ds_BGRTM, q_BTGRK, preferred_element_type=jnp.float32)
    return dq.astype(q_BTGRK.dtype), dk.astype(k_BMGK.dtype)


_qk_16bit.defvjp(_qk_16bit_fwd, _qk_16bit_bwd)


def cached_attention(q_BTHK, k_BMGK, v_BMGK, positions_T, window: int | None,
                     segments_BL=None, softcap: float = 0.0, sinks=None):
    """T queries at positions_T ([T], or [B, T]: each row's own) against M keys at positions
    0..M-1: full score matrix, mask, float32 softmax. When decoding, the keys are a cache
    whose slots past each query's position are unwritten; the causal mask hides them.
    segments_BL (self-attention, T = M): the document masks of the module docstring. sinks:
    [H] learned logits (the sinks part), one more column of every query's softmax whose
    probability is dropped."""
    b, t, heads, head_dim = q_BTHK.shape
    groups = k_BMGK.shape[2]
    q_BTGRK = q_BTHK.reshape(b, t, groups, heads // groups, head_dim)
    scores_BGRTM = _scores(q_BTGRK, k_BMGK)
    if softcap:  # the soft-cap part: c·tanh(s/c), before the mask (as transformers)
        scores_BGRTM = softcap * jnp.tanh(scores_BGRTM / softcap)
    if positions_T.ndim == 2:  # each row at its own position (batched decoding)
        visible_TM = decode_cache.visible(positions_T, k_BMGK.shape[1], window)[:, None, None]
    else:
        visible_TM = causal_mask(positions_T, jnp.arange(k_BMGK.shape[1]), window)
    if segments_BL is not None:
        visible_TM = (visible_TM & same_document(segments_BL, segments_BL))[:, None, None]
    # The mask as an added bias, not a select: a select's gradient needs the mask, which
    # the backward pass then keeps broadcast to the scores' shape, once per layer kind (a
    # pattern's sliding and full masks: 2 GB a device at gpt-oss-20b's shape); an add's
    # does not. finfo.min plus any score rounds to finfo.min, so the masked scores are as
    # the select's, and their probabilities, hence their gradients, exactly 0.
    bias = jnp.where(visible_TM, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
    scores_BGRTM = scores_BGRTM + bias
    if sinks is None:
        probs_BGRTM = jax.nn.softmax(scores_BGRTM, axis=-1).astype(v_BMGK.dtype)
    else:
        sink_GR = sinks.astype(jnp.float32).reshape(groups, heads // groups)
        sink_BGRT1 = jnp.broadcast_to(sink_GR[None, :, :, None, None],
                                      scores_BGRTM.shape[:-1] + (1,))
        probs_BGRTM = jax.nn.softmax(jnp.concatenate([scores_BGRTM, sink_BGRT1], axis=-1),
                                     axis=-1)[..., :-1].astype(v_BMGK.dtype)
    out_BTGRK = jnp.einsum("bgrtm,bmgk->btgrk", probs_BGRTM, v_BMGK)
    return out_BTGRK.reshape(b, t, heads, v_BMGK.shape[-1])  # v's head dim (MLA's differs)


def xla_attention(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array,
                  window: int | None = None, segments_BL=None, softcap: float = 0.0,
                  sinks=None) -> jax.Array:
    """Reference causal attention; softcap: the attention-logit soft-cap (0: none); sinks:
    [H] attention-sink logits (None: none)."""
    return cached_attention(q_BLHK, k_BMGK, v_BMGK, jnp.arange(q_BLHK.shape[1]), window,
                            segments_BL, softcap, sinks)
