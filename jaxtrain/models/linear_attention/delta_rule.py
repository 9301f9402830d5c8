"""The gated delta rule, in its two forms: chunked (training and prefill) and recurrent
(decoding), over one recurrent state S [B, H, K, V] per layer.

Per head and token t (q_t, k_t L2-normalised, q_t also scaled by 1/√K; g_t ≤ 0 the log
decay, β_t ∈ (0, 1) the write strength):

    S ← exp(g_t)·S
    S ← S + k_t ⊗ β_t·(v_t − Sᵀk_t)      (the delta rule: a write that corrects what S
    o_t = Sᵀq_t                            reads back at k_t)

The chunked form runs C tokens at a time with the WY representation: within a chunk the
corrections are (I + A)⁻¹ with A strictly lower triangular (A_ij = β_i k_i·k_j e^{G_i−G_j},
G the chunk's cumulative decay), log2(C) matmuls rather than C sequential steps; the
state passes from chunk to chunk in a lax.scan. Padding the length up to a multiple of C
with k = v = 0, β = 0, g = 0 leaves the outputs and the final state as they are (a padded
token neither decays nor writes). Everything here is float32 (the decays are exponents).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _pad_to(x, length: int, axis: int = 1):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad)


def _unit_lower_inverse(a_xCC):
    """(I + A)⁻¹ for strictly lower triangular A [..., C, C]: A is nilpotent (A^C = 0), so
    (I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)···, log2(C) batched matmuls (a batched triangular
    solve of these small matrices is ~50× slower on CPU, and this form batches on any
    device)."""
    c = a_xCC.shape[-1]
    eye = jnp.eye(c, dtype=a_xCC.dtype)
    power, inverse = -a_xCC, eye - a_xCC
    for _ in range(max(0, (c - 1).bit_length() - 1)):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def _chunk_prep(k, v, g, beta):
    """Per chunk ([..., C, ·], every batch, head and chunk at once): the WY pieces that
    need no state. Returns (corrected values u [.., C, V], decayed corrected keys w
    [.., C, K], cumulative decay G [.., C], decay mask [.., C, C] exp(G_i − G_j) on and
    below the diagonal)."""
    c = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((c, c), bool))
    # Masked before exp: above the diagonal G_i − G_j > 0 and could overflow (then 0·inf).
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)) * lower
    kb = k * beta[..., None]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    a = jnp.where(strict, jnp.einsum("...ik,...jk->...ij", kb, k) * decay, 0.0)
    t = _unit_lower_inverse(a)
    u = t @ (v * beta[..., None])
    w = t @ (kb * jnp.exp(cum)[..., None])
    return u, w, cum, decay


def _chunk_step(s_BHKV, chunk):
    """One chunk of every row and head against the state entering it: (state leaving it,
    outputs [B, H, C, V])."""
    q, k, u, w, cum, decay = chunk
    new = u - w @ s_BHKV  # the values still to write once S's reads are corrected
    scores = jnp.einsum("...ik,...jk->...ij", q, k) * decay
    o = (q * jnp.exp(cum)[..., None]) @ s_BHKV + scores @ new
    last = cum[..., -1:]
    s_BHKV = s_BHKV * jnp.exp(last)[..., None] + jnp.swapaxes(
        k * jnp.exp(last - cum)[..., None], -1, -2) @ new
    return s_BHKV, o


def chunked(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, chunk: int, state_BHKV=None):
    """The gated delta rule C = `chunk` tokens at a time: (o_BLHV float32, final state
    [B, H, K, V]). state_BHKV: the state before the first token (None: zeros)."""
    b, length, h, k = q_BLHK.shape
    v = v_BLHV.shape[-1]
    n = -(-length // chunk)
    f32 = jnp.float32

    def by_chunk(x, *tail):  # [B, L, H, ...] -> [n, B, H, C, ...]: the scan's axis first
        x = _pad_to(x.astype(f32), n * chunk)
        x = x.reshape(b, n, chunk, h, *tail)
        return jnp.moveaxis(jnp.moveaxis(x, 3, 1), 2, 0)

    q, kk, vv = by_chunk(q_BLHK, k), by_chunk(k_BLHK, k), by_chunk(v_BLHV, v)
    g, beta = by_chunk(g_BLH), by_chunk(beta_BLH)
    # Recomputed in the backward pass from its inputs: the inverse's log2(C) products of
    # [C, C] per chunk and head would otherwise all be kept (most of the layer's memory).
    u, w, cum, decay = jax.checkpoint(
        _chunk_prep, policy=jax.checkpoint_policies.nothing_saveable)(kk, vv, g, beta)
    if state_BHKV is None:
        state_BHKV = jnp.zeros((b, h, k, v), f32)
    state, o = jax.lax.scan(_chunk_step, state_BHKV.astype(f32), (q, kk, u, w, cum, decay))
    # [n, B, H, C, V] -> [B, n, C, H, V]
    o_BLHV = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, n * chunk, h, v)[:, :length]
    return o_BLHV, state


def _token_step(s_BHKV, token):
    q_BHK, k_BHK, v_BHV, g_BH, beta_BH = token
    s_BHKV = s_BHKV * jnp.exp(g_BH)[..., None, None]
    read_BHV = jnp.einsum("bhkv,bhk->bhv", s_BHKV, k_BHK)
    delta_BHV = (v_BHV - read_BHV) * beta_BH[..., None]
    s_BHKV = s_BHKV + k_BHK[..., :, None] * delta_BHV[..., None, :]
    return s_BHKV, jnp.einsum("bhkv,bhk->bhv", s_BHKV, q_BHK)


def recurrent(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, state_BHKV):
    """The gated delta rule token by token from state_BHKV (decoding: L = 1, one step):
    (o_BLHV float32, final state)."""
    f32 = jnp.float32
    tokens = tuple(jnp.moveaxis(x.astype(f32), 1, 0)
                   for x in (q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH))
    state, o_LBHV = jax.lax.scan(_token_step, state_BHKV.astype(f32), tokens)
    return jnp.moveaxis(o_LBHV, 0, 1), state
