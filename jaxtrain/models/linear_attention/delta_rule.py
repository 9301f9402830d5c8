"""The gated delta rule, in its two forms: chunked (training and prefill) and recurrent
(decoding), over one recurrent state S [B, H, K, V] per layer.

Per head and token t (q_t, k_t L2-normalised, q_t also scaled by 1/√K; g_t ≤ 0 the log
decay, β_t ∈ (0, 1) the write strength):

    S ← exp(g_t)·S
    S ← S + k_t ⊗ β_t·(v_t − Sᵀk_t)      (the delta rule: a write that corrects what S
    o_t = Sᵀq_t                            reads back at k_t)

The chunked form runs C tokens at a time with the WY representation: within a chunk the
corrections are (I + A)⁻¹ with A strictly lower triangular (A_ij = β_i k_i·k_j e^{G_i−G_j},
G the chunk's cumulative decay), one triangular solve rather than C sequential steps; the
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


def _chunk_prep(k_CK, v_CV, g_C, beta_C):
    """Per chunk (vmapped over batch, heads and chunks): the WY pieces that need no state.
    Returns (corrected values u [C, V], decayed corrected keys w [C, K], cumulative decay
    G [C], decay mask [C, C] exp(G_i − G_j) on and below the diagonal)."""
    c = g_C.shape[0]
    cum_C = jnp.cumsum(g_C)
    lower = jnp.tril(jnp.ones((c, c), bool))
    # Masked before exp: above the diagonal G_i − G_j > 0 and could overflow (then 0·inf).
    decay_CC = jnp.exp(jnp.where(lower, cum_C[:, None] - cum_C[None, :], 0.0)) * lower
    kb_CK = k_CK * beta_C[:, None]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    a_CC = jnp.where(strict, (kb_CK @ k_CK.T) * decay_CC, 0.0)
    # T = (I + A)⁻¹, by forward substitution (unit lower triangular).
    t_CC = jax.scipy.linalg.solve_triangular(a_CC + jnp.eye(c, dtype=a_CC.dtype),
                                             jnp.eye(c, dtype=a_CC.dtype), lower=True,
                                             unit_diagonal=True)
    u_CV = t_CC @ (v_CV * beta_C[:, None])
    w_CK = t_CC @ (kb_CK * jnp.exp(cum_C)[:, None])
    return u_CV, w_CK, cum_C, decay_CC


def _chunk_step(s_KV, chunk):
    """One chunk against the state entering it: (state leaving it, outputs [C, V])."""
    q_CK, k_CK, u_CV, w_CK, cum_C, decay_CC = chunk
    new_CV = u_CV - w_CK @ s_KV  # the values still to write once S's reads are corrected
    scores_CC = (q_CK @ k_CK.T) * decay_CC
    o_CV = (q_CK * jnp.exp(cum_C)[:, None]) @ s_KV + scores_CC @ new_CV
    last = cum_C[-1]
    s_KV = s_KV * jnp.exp(last) + (k_CK * jnp.exp(last - cum_C)[:, None]).T @ new_CV
    return s_KV, o_CV


def chunked(q_BLHK, k_BLHK, v_BLHV, g_BLH, beta_BLH, chunk: int, state_BHKV=None):
    """The gated delta rule C = `chunk` tokens at a time: (o_BLHV float32, final state
    [B, H, K, V]). state_BHKV: the state before the first token (None: zeros)."""
    b, length, h, k = q_BLHK.shape
    v = v_BLHV.shape[-1]
    n = -(-length // chunk)
    f32 = jnp.float32

    def by_chunk(x, *tail):  # [B, L, H, ...] -> [B, H, n, C, ...]
        x = _pad_to(x.astype(f32), n * chunk)
        x = x.reshape(b, n, chunk, h, *tail)
        return jnp.moveaxis(x, 3, 1)

    q, kk, vv = by_chunk(q_BLHK, k), by_chunk(k_BLHK, k), by_chunk(v_BLHV, v)
    g, beta = by_chunk(g_BLH), by_chunk(beta_BLH)
    prep = jax.vmap(jax.vmap(jax.vmap(_chunk_prep)))
    u, w, cum, decay = prep(kk, vv, g, beta)
    if state_BHKV is None:
        state_BHKV = jnp.zeros((b, h, k, v), f32)

    def scan_head(s_KV, q_n, k_n, u_n, w_n, cum_n, decay_n):
        return jax.lax.scan(_chunk_step, s_KV, (q_n, k_n, u_n, w_n, cum_n, decay_n))

    state, o = jax.vmap(jax.vmap(scan_head))(state_BHKV.astype(f32), q, kk, u, w, cum, decay)
    o_BLHV = jnp.moveaxis(o, 1, 3).reshape(b, n * chunk, h, v)[:, :length]
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
