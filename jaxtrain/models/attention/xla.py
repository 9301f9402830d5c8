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
    """T queries at positions_T ([T]) against M keys at positions 0..M-1: full score
    matrix, mask, float32 softmax. segments_BL (self-attention, T = M): the document masks
    of the module docstring. sinks: [H] learned logits (the sinks part), one more column of
    every query's softmax whose probability is dropped."""
    visible_TM = causal_mask(positions_T, jnp.arange(k_BMGK.shape[1]), window)
    if segments_BL is not None:
        visible_TM = (visible_TM & same_document(segments_BL, segments_BL))[:, None, None]
    return _attend(q_BTHK, [(k_BMGK, v_BMGK, visible_TM)], softcap, sinks)


def decode_attention(q_BTHK, cache: tuple, new: tuple, positions_xT, window: int | None,
                     softcap: float = 0.0, sinks=None):
    """T new tokens at positions_xT ([T], or [B, T]: each row's own) against two blocks of
    keys (models/attention/cache.py): the cache's (k, v [B, G, M, K]) before each row's
    start, and their own (k, v [B, G, T, K]), one softmax over both."""
    (k_BGMK, v_BGMK), (k_BGTK, v_BGTK) = cache, new
    blocks = [(k_BGMK, v_BGMK, decode_cache.visible_cached(positions_xT, k_BGMK.shape[2],
                                                           window)),
              (k_BGTK, v_BGTK, decode_cache.visible_new(positions_xT, window))]
    if positions_xT.ndim == 2:  # [B, T, M] per row, under the kv heads and their repeats
        blocks = [(k, v, visible[:, None, None]) for k, v, visible in blocks]
    return _attend(q_BTHK, blocks, softcap, sinks, keys="bgmk")


def _attend(q_BTHK, blocks, softcap: float, sinks, keys: str = "bmgk"):
    """Attention over blocks of keys [(k, v, visible: bool, broadcast to [B, G, R, T,
    M_i])], one float32 softmax over all of them (and the sinks' column). keys: the
    blocks' layout, "bmgk" (a layer's projections, [B, M, G, K]) or "bgmk" (the decoding
    cache's)."""
    b, t, heads, head_dim = q_BTHK.shape
    groups = blocks[0][0].shape[keys.index("g")]
    q_BTGRK = q_BTHK.reshape(b, t, groups, heads // groups, head_dim)
    parts = []
    for k_BxK, _, visible in blocks:
        if keys == "bmgk":  # (its 16-bit backward: _scores)
            scores_BGRTM = _scores(q_BTGRK, k_BxK)
        else:  # decoding: no backward
            scores_BGRTM = jnp.einsum(f"btgrk,{keys}->bgrtm", q_BTGRK, k_BxK,
                                      preferred_element_type=jnp.float32)
        if softcap:  # the soft-cap part: c·tanh(s/c), before the mask (as transformers)
            scores_BGRTM = softcap * jnp.tanh(scores_BGRTM / softcap)
        # The mask as an added bias, not a select: a select's gradient needs the mask,
        # which the backward pass then keeps broadcast to the scores' shape, once per layer
        # kind (a pattern's sliding and full masks: 2 GB a device at gpt-oss-20b's shape);
        # an add's does not. finfo.min plus any score rounds to finfo.min, so the masked
        # scores are as the select's, and their probabilities, hence their gradients,
        # exactly 0.
        bias = jnp.where(visible, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
        parts.append(scores_BGRTM + bias)
    if sinks is not None:
        sink_GR = sinks.astype(jnp.float32).reshape(groups, heads // groups)
        parts.append(jnp.broadcast_to(sink_GR[None, :, :, None, None],
                                      parts[0].shape[:-1] + (1,)))
    probs = [p.astype(blocks[0][1].dtype) for p in decode_cache.joint_softmax(parts)]
    out_BTGRK = None
    for p_BGRTM, (_, v_BxK, _) in zip(probs, blocks):
        if keys == "bmgk":
            term = jnp.einsum("bgrtm,bmgk->btgrk", p_BGRTM, v_BxK)
        else:  # probabilities on the left: [R·T, M]·[M, K] per (b, g), a plain matmul
            p_BGQM = p_BGRTM.reshape(b, groups, heads // groups * t, p_BGRTM.shape[-1])
            term = jax.lax.dot_general(p_BGQM, v_BxK, (((3,), (2,)), ((0, 1), (0, 1))))
            term = term.reshape(b, groups, heads // groups, t, -1).transpose(0, 3, 1, 2, 4)
        out_BTGRK = term if out_BTGRK is None else out_BTGRK + term
    return out_BTGRK.reshape(b, t, heads, blocks[0][1].shape[-1])  # v's head dim (MLA's)


def xla_attention(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array,
                  window: int | None = None, segments_BL=None, softcap: float = 0.0,
                  sinks=None) -> jax.Array:
    """Reference causal attention; softcap: the attention-logit soft-cap (0: none); sinks:
    [H] attention-sink logits (None: none)."""
    return cached_attention(q_BLHK, k_BMGK, v_BMGK, jnp.arange(q_BLHK.shape[1]), window,
                            segments_BL, softcap, sinks)
