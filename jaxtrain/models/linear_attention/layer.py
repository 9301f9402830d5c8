"""The Gated DeltaNet layer (model.layer_types `linear_attention`), as transformers'
Qwen3.5 / Qwen3-Next define it: projections q, k (key heads), v, z (value heads), a, b (one
each per value head); a short causal depthwise conv1d over q, k and v then SiLU; q and k
L2-normalised (q also ×1/√K); decay g = −exp(A_log)·softplus(a + dt_bias), write strength
β = σ(b); the gated delta rule (delta_rule.py: chunked for training and prefill, recurrent
for decoding); each value head RMS-normed, times its weight and SiLU(z); the output
projection. Its decode cache is constant in size: the conv's last W−1 inputs and the
recurrent state S [B, H, K, V], per layer (one slot never grows).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import fail
from jaxtrain.mesh import constrain
from jaxtrain.models.layers import dense, param
from jaxtrain.models.linear_attention import delta_rule


def defaults() -> dict:
    """model.linear_attention: the shape of the `linear_attention` layers (HF's linear_*)."""
    return {"num_key_heads": 0, "num_value_heads": 0,  # 0: model.num_kv_heads, num_heads
            "key_head_dim": 0, "value_head_dim": 0,  # 0: model.head_dim
            "conv_kernel": 4,  # the causal conv1d's width W (linear_conv_kernel_dim)
            "chunk_size": 64}  # tokens per chunk of the chunked form (training, prefill)


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv: int
    chunk: int

    @classmethod
    def from_config(cls, m) -> LinearSpec:
        s, head_dim = m.linear_attention, m.head_dim or m.d_model // m.num_heads
        return cls(s.num_key_heads or m.num_kv_heads or m.num_heads,
                   s.num_value_heads or m.num_heads, s.key_head_dim or head_dim,
                   s.value_head_dim or head_dim, s.conv_kernel, s.chunk_size)

    def matmul_params(self, d_model: int) -> int:
        """Planner: the weights of a token's matmuls in one layer (q, k, v, z, a, b, out)."""
        hk, hv = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return d_model * (2 * hk + 2 * hv + 2 * self.value_heads) + hv * d_model

    def delta_rule_flops_per_token(self, chunk: int | None = None) -> float:
        """Planner: the chunked delta rule's forward FLOPs per token and layer, beyond the
        projections, for chunks of `chunk` tokens (default the layer's): per value head and
        chunk of C, the WY pieces (k·kᵀ 2C²K, the triangular solve C³, u and w 2C²(V + K))
        and the chunk's step (q·kᵀ 2C²K, three C×K×V products with the state 6CKV, scores
        times values 2C²V); the conv 2W per channel and the gated norm ~6 per value."""
        c, k, v = chunk or self.chunk, self.key_dim, self.value_dim
        per_head = 6 * c * k + c * c + 4 * c * v + 6 * k * v
        channels = 2 * self.key_heads * k + self.value_heads * v
        return self.value_heads * (per_head + 6 * v) + 2 * self.conv * channels

    def recurrent_flops_per_token(self) -> float:
        """Planner: one decode step's delta rule per layer: decay, read, write and output
        of the K×V state per value head (~7KV)."""
        return 7.0 * self.value_heads * self.key_dim * self.value_dim

    def state_bytes(self, compute_bytes: int) -> int:
        """Planner: one slot's decode state per layer: S [H, K, V] in float32 and the
        conv's last W−1 inputs in the compute dtype, whatever the length."""
        conv = self.state_values - self.value_heads * self.key_dim * self.value_dim
        return 4 * self.value_heads * self.key_dim * self.value_dim + compute_bytes * conv

    @property
    def state_values(self) -> int:
        """Values one slot keeps per layer: the recurrent state and the conv's inputs."""
        channels = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        return self.value_heads * self.key_dim * self.value_dim + (self.conv - 1) * channels


def check(m) -> None:
    """One-line ConfigErrors for model.linear_attention, when a layer is linear."""
    s = LinearSpec.from_config(m)
    for key in ("conv_kernel", "chunk_size"):
        if m.linear_attention[key] < 1:
            fail(f"model.linear_attention.{key}", m.linear_attention[key], "must be >= 1")
    if s.value_heads % s.key_heads:
        fail("model.linear_attention.num_value_heads", s.value_heads, f"must be a multiple "
             f"of model.linear_attention.num_key_heads={s.key_heads}")


def causal_conv(x_BLC, w_WC, prefix_BWC=None):
    """Depthwise causal conv1d (no bias) then SiLU: out[t] = Σ_i w[i]·x[t − (W−1) + i];
    prefix_BWC: the W−1 inputs before x (decoding's conv state; None: zeros)."""
    width = w_WC.shape[0]
    if prefix_BWC is None:
        prefix_BWC = jnp.zeros((x_BLC.shape[0], width - 1, *x_BLC.shape[2:]), x_BLC.dtype)
    full = jnp.concatenate([prefix_BWC.astype(x_BLC.dtype), x_BLC], axis=1)
    length = x_BLC.shape[1]
    out = sum(full[:, i:i + length] * w_WC[i] for i in range(width))
    return jax.nn.silu(out)


def l2_normalize(x, eps: float = 1e-6):
    """x/√(Σx² + eps) over the last axis, in float32 (transformers' and FLA's l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt((x * x).sum(-1, keepdims=True) + eps)


class GatedDeltaNet(nnx.Module):
    def __init__(self, spec, *, rngs: nnx.Rngs):
        self.spec, ls = spec, spec.linear
        d, hk, hv, k, v = spec.d_model, ls.key_heads, ls.value_heads, ls.key_dim, ls.value_dim
        std, dt = spec.init_std, spec.param_dtype
        self.w_q = param(rngs, (d, hk, k), ("embed", "kv_heads", "kv"), std, dt)
        self.w_k = param(rngs, (d, hk, k), ("embed", "kv_heads", "kv"), std, dt)
        self.w_v = param(rngs, (d, hv, v), ("embed", "heads", "kv"), std, dt)
        self.w_z = param(rngs, (d, hv, v), ("embed", "heads", "kv"), std, dt)
        self.w_a = param(rngs, (d, hv), ("embed", "heads"), std, dt)
        self.w_b = param(rngs, (d, hv), ("embed", "heads"), std, dt)
        conv_std = ls.conv ** -0.5
        self.conv_q = param(rngs, (ls.conv, hk, k), (None, "kv_heads", "kv"), conv_std, dt)
        self.conv_k = param(rngs, (ls.conv, hk, k), (None, "kv_heads", "kv"), conv_std, dt)
        self.conv_v = param(rngs, (ls.conv, hv, v), (None, "heads", "kv"), conv_std, dt)
        self.dt_bias = param(rngs, (hv,), ("heads",), None, dt)
        # A = 1 at birth (transformers draws A ~ U(0.01, 16); an import brings its own).
        self.A_log = param(rngs, (hv,), ("heads",), 0.0, dt)
        self.norm = param(rngs, (v,), ("kv",), None, dt)
        self.w_o = param(rngs, (hv, v, d), ("heads", "kv", "embed"),
                         std / (2 * spec.num_layers) ** 0.5, dt)

    def _inputs(self, x_BLD, conv_state=None):
        """(q, k, v, g, β, z, the conv's inputs): q/k repeated to the value heads."""
        spec, ls = self.spec, self.spec.linear
        rules = spec.rules
        proj = {n: dense(spec, "bld,dhk->blhk", x_BLD, getattr(self, f"w_{n}")[...])
                for n in ("q", "k", "v", "z")}
        prefixes = conv_state or (None, None, None)
        conv_in = [proj[n] for n in ("q", "k", "v")]
        q, k, v = (causal_conv(x, getattr(self, f"conv_{n}")[...].astype(x.dtype), p)
                   for x, n, p in zip(conv_in, "qkv", prefixes))
        rep = ls.value_heads // ls.key_heads
        q = jnp.repeat(l2_normalize(q) * ls.key_dim ** -0.5, rep, axis=2)
        k = jnp.repeat(l2_normalize(k), rep, axis=2)
        a = dense(spec, "bld,dh->blh", x_BLD, self.w_a[...]).astype(jnp.float32)
        b = dense(spec, "bld,dh->blh", x_BLD, self.w_b[...]).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a + self.dt_bias[...].astype(jnp.float32))
        axes = ("batch", "length", "heads", "kv")
        q, k, v = (constrain(t, axes, rules) for t in (q, k, v))
        return q, k, v, g, jax.nn.sigmoid(b), proj["z"], conv_in

    def _output(self, o_BLHV, z_BLHV):
        """Each value head RMS-normed (float32) times its weight and SiLU(z), projected."""
        spec = self.spec
        o = o_BLHV.astype(jnp.float32)
        o = o * jax.lax.rsqrt((o * o).mean(-1, keepdims=True) + spec.norm_eps)
        o = (self.norm[...].astype(jnp.float32) * o) * jax.nn.silu(z_BLHV.astype(jnp.float32))
        o = o.astype(spec.compute_dtype)
        return dense(spec, "blhk,hkd->bld", o, self.w_o[...])

    def __call__(self, x_BLD):
        q, k, v, g, beta, z, _ = self._inputs(x_BLD)
        o, _ = delta_rule.chunked(q, k, v, g, beta, self.spec.linear.chunk)
        return self._output(o, z)

    def decode(self, x_BTD, cache: tuple, start, valid=None):
        """T new tokens from the layer's cache (conv_q, conv_k, conv_v [B, W−1, heads, dim],
        state [B, H, K, V]): (y_BTD, cache). A row at start 0 begins afresh (an engine's
        slot taken by a new request); valid: the real tokens of a padded prefill (its
        padding neither decays nor writes the state, nor enters the conv's)."""
        fresh_B = jnp.broadcast_to(jnp.asarray(start) == 0, (x_BTD.shape[0],))
        cache = tuple(jnp.where(fresh_B.reshape((-1,) + (1,) * (c.ndim - 1)),
                                jnp.zeros_like(c), c) for c in cache)
        *conv_state, state = cache
        q, k, v, g, beta, z, conv_in = self._inputs(x_BTD, tuple(conv_state))
        end = x_BTD.shape[1]
        if valid is not None:
            real_T = jnp.arange(end) < valid
            g, beta, end = g * real_T[None, :, None], beta * real_T[None, :, None], valid
        # The next conv state: the W−1 inputs before token `end` (of prefix then x).
        new_conv = tuple(jax.lax.dynamic_slice_in_dim(
            jnp.concatenate([p.astype(x.dtype), x], 1), end, self.spec.linear.conv - 1, 1)
            for p, x in zip(conv_state, conv_in))
        if x_BTD.shape[1] == 1:
            o, state = delta_rule.recurrent(q, k, v, g, beta, state)
        else:
            o, state = delta_rule.chunked(q, k, v, g, beta, self.spec.linear.chunk, state)
        new = tuple(n.astype(c.dtype) for n, c in zip((*new_conv, state), cache))
        return self._output(o, z), new

    def init_cache(self, batch: int, dtype) -> tuple:
        """Zeros of one layer's cache (decode's): the conv's inputs and the state."""
        ls = self.spec.linear
        w = ls.conv - 1
        return (jnp.zeros((batch, w, ls.key_heads, ls.key_dim), dtype),
                jnp.zeros((batch, w, ls.key_heads, ls.key_dim), dtype),
                jnp.zeros((batch, w, ls.value_heads, ls.value_dim), dtype),
                jnp.zeros((batch, ls.value_heads, ls.key_dim, ls.value_dim), jnp.float32))
