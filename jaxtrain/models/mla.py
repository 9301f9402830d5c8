"""Multi-head latent attention (MLA, DeepSeek-V2/V3): an attention part beside GQA.

Every head's keys and values come from one shared latent per token: x → [c (kv_lora_rank),
k_rope (qk_rope_head_dim)]; c is RMS-normed and expanded per head into k_nope
(qk_nope_head_dim) and v (v_head_dim, which may differ from q/k's head dim). k_rope is
one rotary key shared by every head. q is projected at full rank, or through a low-rank
down/up pair (q_lora_rank) with its own RMSNorm, and split into q_nope and q_rope. A
head's score is q_nope·k_nope + q_rope·k_rope, scaled by (nope + rope dims)^-½ (or the
importer's `softmax_scale`, for YaRN's mscale).

The rotary part is DeepSeek's interleaved layout (`rope_interleave`, transformers'
default): pairs (x0, x1), (x2, x3), ... share a frequency. De-interleaving the features
(evens, then odds) turns it into the rotate-half rotation models/rope.py runs, exactly as
transformers' apply_rotary_pos_emb_interleave computes it; q and k are permuted alike, so
their products are unchanged.

Training runs the expanded q, k, v through the `model.attention` kernel; not every kernel
takes a v head dim other than q/k's (`kernel_problem`). Decoding caches the latent, c and
k_rope: kv_lora_rank + qk_rope_head_dim numbers per token and layer, against GQA's
2·kv_heads·head_dim (`cache_bytes_per_token`). The up-projections are absorbed: the
query's nope part is taken into the latent space (q_nope·W_kᵀ, [heads, kv_lora_rank]),
scores are formed against c directly, the probabilities average c, and W_v then W_o map
the result out, as DeepSeek's inference does; k and v are never expanded.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import fail
from jaxtrain.models.attention import cache as decode_cache
from jaxtrain.models.attention.kernels import KERNELS, resolve_attention
from jaxtrain.models.layers import Norm, dense, param
from jaxtrain.models.rope import rope


@dataclasses.dataclass(frozen=True)
class MlaSpec:
    """model.mla, resolved once (the module docstring has the fields; transformers' names)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q at full rank
    rope_interleave: bool = True
    norm_eps: float = 1e-6  # the latents' RMSNorms (transformers: fixed 1e-6)
    softmax_scale: float = 0.0  # 0: qk_head_dim^-½

    @classmethod
    def from_config(cls, section) -> MlaSpec | None:
        if not section.kv_lora_rank:
            return None
        return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale or self.qk_head_dim ** -0.5

    def cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """Planner fact: one layer's decoding cache per token (the latent and the rotary
        key), against gqa_cache_bytes_per_token for GQA."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes

    def matmul_params(self, d_model: int, heads: int) -> int:
        """Planner fact: weights one token multiplies with in training (2 FLOPs each)."""
        q = (d_model * self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
             if self.q_lora_rank else d_model * heads * self.qk_head_dim)
        kv = (d_model * (self.kv_lora_rank + self.qk_rope_head_dim)
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + heads * self.v_head_dim * d_model

    def score_flops_per_token(self, heads: int, keys: int) -> int:
        """Planner fact: QKᵀ and PV FLOPs of one query against `keys` keys (q/k and v head
        dims differ, so GQA's 4·heads·head_dim·keys does not apply)."""
        return 2 * heads * keys * (self.qk_head_dim + self.v_head_dim)


def gqa_cache_bytes_per_token(kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """One GQA layer's kv cache per token: k and v of every kv head."""
    return 2 * kv_heads * head_dim * dtype_bytes


def defaults() -> dict:
    """The `model.mla` section; kv_lora_rank 0: the layer's attention is GQA."""
    return {
        "kv_lora_rank": 0,  # the shared kv latent per token (DeepSeek-V3: 512); 0: MLA off
        "q_lora_rank": 0,  # q's low-rank bottleneck (DeepSeek-V3: 1536); 0: full rank
        "qk_nope_head_dim": 128,  # per head, q/k features without rotary embedding
        "qk_rope_head_dim": 64,  # per head, q/k rotary features (k's shared by all heads)
        "v_head_dim": 128,  # per head, v's features (need not equal q/k's)
        "rope_interleave": True,  # DeepSeek's interleaved rotary pairs
        "norm_eps": 1e-6,
        "softmax_scale": 0.0,  # 0: (qk_nope + qk_rope)^-½
    }


# ---------------------------------------------------------------------------------------
# Which kernels take v's head dim: read from the kernel itself, by tracing it (forward and
# backward) on abstract arrays whose v head dim differs, at the run's sequence length (the
# chunked kernel loops, on another code path, past 16 chunks). A kernel that raises or
# returns q's head dim cannot.

@functools.cache
def takes_value_head_dim(kernel: str, seq_len: int) -> bool:
    fn = KERNELS[kernel]
    q = jax.ShapeDtypeStruct((1, seq_len, 2, 8), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, seq_len, 2, 4), jnp.bfloat16)

    def loss(q, k, v):
        return fn(q, k, v, None, rules=()).astype(jnp.float32).sum()

    try:
        out = jax.eval_shape(lambda q, k, v: fn(q, k, v, None, rules=()), q, q, v)
        jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, q, v)
    except Exception:  # noqa: BLE001 - any refusal of the shapes is a "no"
        return False
    return out.shape[-1] == 4


def kernel_problem(kernel: str, seq_len: int, context: int = 1) -> str | None:
    """Why `kernel` cannot run MLA (None: it can); context: the mesh's context size (the
    context-parallel kernel keeps q's head dim in its flash accumulators)."""
    if context > 1:
        return ("MLA's v head dim differs from q/k's and the context-parallel attention "
                "keeps q's; use mesh.context=1")
    if takes_value_head_dim(kernel, seq_len):
        return None
    able = [k for k in KERNELS if takes_value_head_dim(k, seq_len)]
    return (f"it cannot run MLA's v head dim (unlike q/k's) at model.seq_len={seq_len}; "
            f"use {' or '.join(able) or 'a shorter model.seq_len with chunked'}")


def resolve_kernel(name: str, precision: str, platform: str, seq_len: int,
                   window: int = 0, documents: bool = False) -> str | None:
    """`model.attention` for MLA layers: resolve_attention's choice, except that 'auto'
    takes only kernels that take MLA's v head dim (on GPUs it would pick cuDNN, which does
    not): the first whose auto_on is the platform, else chunked, else any that runs here;
    None when none can (the check refuses that config)."""
    if name != "auto":
        return resolve_attention(name, precision, platform, seq_len, window, documents)
    def able(kernel) -> bool:
        return (takes_value_head_dim(kernel.name, seq_len)
                and not kernel.problem(precision, platform, seq_len, window, documents))

    preferred = [k for k in KERNELS.values() if k.auto_on == platform]
    fallback = [KERNELS["chunked"], *KERNELS.values()]
    return next((k.name for k in preferred + fallback if able(k)), None)


def check(c, sizes: dict[str, int] | None = None, platform: str | None = None) -> None:
    """ConfigError for a model.mla setting that cannot work; sizes: the mesh's axis sizes
    (None before the mesh is known); platform: the devices' (None: not known yet)."""
    m = c.model.mla
    if not m.kv_lora_rank:
        return
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if m[key] < 1:
            fail(f"model.mla.{key}", m[key], "must be >= 1")
    if m.q_lora_rank < 0:
        fail("model.mla.q_lora_rank", m.q_lora_rank, "must be >= 0 (0: q at full rank)")
    if m.qk_rope_head_dim < 2 or m.qk_rope_head_dim % 2:
        fail("model.mla.qk_rope_head_dim", m.qk_rope_head_dim, "must be even and >= 2 "
             "(rotary pairs)")
    if m.norm_eps <= 0 or m.softmax_scale < 0:
        fail("model.mla.norm_eps" if m.norm_eps <= 0 else "model.mla.softmax_scale",
             m.norm_eps if m.norm_eps <= 0 else m.softmax_scale, "must be > 0 (scale: >= 0)")
    shards = (sizes or {}).get("fsdp", 1)
    for key in ("kv_lora_rank", "q_lora_rank"):  # sharded as d_model is (Mla.__init__)
        if m[key] % shards:
            fail(f"model.mla.{key}", m[key], f"must divide by mesh.fsdp={shards} (FSDP "
                 "shards the latent's rank)")
    context = (sizes or {}).get("context", 1)
    if context > 1:
        fail("mesh.context", context, kernel_problem("chunked", c.model.seq_len, context))
    if c.model.attention != "auto":
        if why := kernel_problem(c.model.attention, c.model.seq_len):
            fail("model.attention", c.model.attention, why)
    elif platform is not None and resolve_kernel(
            "auto", c.train.precision, platform, c.model.seq_len) is None:
        fail("model.attention", "auto", f"no kernel on {platform} runs MLA's v head dim "
             f"(unlike q/k's) at model.seq_len={c.model.seq_len}; use a shorter model.seq_len")


@dataclasses.dataclass(frozen=True)
class AttentionPart:
    """An attention part (GQA, MLA): its module, its check and its planner facts. The
    families-from-parts registry (issue 37) takes this entry as is."""

    name: str
    doc: str
    module: Callable  # (model spec, part spec, rngs=) -> nnx.Module
    check: Callable  # (config, mesh axis sizes or None) -> None, raising ConfigError
    # (part spec, dtype bytes) -> one layer's decoding cache per token
    cache_bytes_per_token: Callable
    # (part spec, d_model, heads) -> weights per token
    matmul_params: Callable


class Mla(nnx.Module):
    """MLA (module docstring). __call__(x_BLD, segments_BL, positions_BL) -> y_BLD;
    decode(x_BTD, cache, start) -> (y_BTD, new entries); init_cache(batch, length, dtype)."""

    def __init__(self, spec, mla: MlaSpec, *, rngs: nnx.Rngs):
        self.spec, self.mla = spec, mla
        d, h, std, dt = spec.d_model, spec.num_heads, spec.init_std, spec.param_dtype
        out_std = spec.init_std / (2 * spec.num_layers) ** 0.5
        rq, rkv = mla.q_lora_rank, mla.kv_lora_rank
        if rq:
            self.w_q_down = param(rngs, (d, rq), ("embed", None), std, dt)
            self.q_norm = Norm(rq, rms=True, eps=mla.norm_eps, dtype=dt, rngs=rngs)
            # The latent's rank is an input dimension: FSDP shards it as it does d_model's
            # (None would replicate every up-projection on each FSDP shard: 3.3B
            # parameters a device at DeepSeek-V3's shape).
            self.w_q_up = param(rngs, (rq, h, mla.qk_head_dim), ("embed", "heads", "kv"), std,
                                dt)
        else:
            self.w_q = param(rngs, (d, h, mla.qk_head_dim), ("embed", "heads", "kv"), std, dt)
        self.w_kv_down = param(rngs, (d, rkv + mla.qk_rope_head_dim), ("embed", None), std, dt)
        self.kv_norm = Norm(rkv, rms=True, eps=mla.norm_eps, dtype=dt, rngs=rngs)
        self.w_k_up = param(rngs, (rkv, h, mla.qk_nope_head_dim), ("embed", "heads", "kv"),
                            std, dt)
        self.w_v_up = param(rngs, (rkv, h, mla.v_head_dim), ("embed", "heads", "kv"), std, dt)
        self.w_o = param(rngs, (h, mla.v_head_dim, d), ("heads", "kv", "embed"), out_std, dt)

    def _rope(self, x_BLHK, positions):
        if self.mla.rope_interleave:  # pairs (x0, x1), ... -> halves (evens, odds)
            x_BLHK = jnp.concatenate([x_BLHK[..., 0::2], x_BLHK[..., 1::2]], axis=-1)
        return rope(x_BLHK, self.spec.rope_theta, positions, self.spec.rope_scaling)

    def _query(self, x_BLD, positions):
        """(q_nope [B, L, H, nope], q_rope [B, L, H, rope] rotated), unscaled."""
        spec, mla = self.spec, self.mla
        if mla.q_lora_rank:
            c_BLR = self.q_norm(dense(spec, "bld,dr->blr", x_BLD, self.w_q_down[...]))
            q_BLHK = dense(spec, "blr,rhk->blhk", c_BLR, self.w_q_up[...])
        else:
            q_BLHK = dense(spec, "bld,dhk->blhk", x_BLD, self.w_q[...])
        nope = mla.qk_nope_head_dim
        return q_BLHK[..., :nope], self._rope(q_BLHK[..., nope:], positions)

    def _latent(self, x_BLD, positions):
        """(c [B, L, kv_lora_rank] normed, k_rope [B, L, rope] rotated): what the cache
        holds."""
        both_BLR = dense(self.spec, "bld,dr->blr", x_BLD, self.w_kv_down[...])
        rkv = self.mla.kv_lora_rank
        k_rope_BL1K = self._rope(both_BLR[:, :, None, rkv:], positions)
        return self.kv_norm(both_BLR[..., :rkv]), k_rope_BL1K[:, :, 0]

    def qkv(self, x_BLD: jax.Array, positions_BL=None, kind: str | None = None):
        """(q [B, L, H, qk] scaled, k [B, L, H, qk], v [B, L, H, v]) expanded from the
        latents, as the Block hands any attention layer's to `attend` (kind: unused, MLA
        layers rotate by the model's rope)."""
        del kind
        spec, mla = self.spec, self.mla
        q_nope_BLHN, q_rope_BLHK = self._query(x_BLD, positions_BL)
        c_BLR, k_rope_BLK = self._latent(x_BLD, positions_BL)
        k_nope_BLHN = dense(spec, "blr,rhk->blhk", c_BLR, self.w_k_up[...])
        v_BLHV = dense(spec, "blr,rhk->blhk", c_BLR, self.w_v_up[...])
        k_rope_BLHK = jnp.broadcast_to(k_rope_BLK[:, :, None], q_rope_BLHK.shape)
        q_BLHQ = jnp.concatenate([q_nope_BLHN, q_rope_BLHK], -1)
        q_BLHQ = q_BLHQ * jnp.asarray(mla.scale, q_BLHQ.dtype)
        k_BLHQ = jnp.concatenate([k_nope_BLHN, k_rope_BLHK.astype(k_nope_BLHN.dtype)], -1)
        return q_BLHQ, k_BLHQ, v_BLHV

    def attend(self, q_BLHQ, k_BLHQ, v_BLHV, segments_BL=None, kind: str | None = None):
        """The `model.attention` kernel on the expanded heads, then the output projection."""
        spec = self.spec
        out_BLHV = KERNELS[spec.attention](q_BLHQ, k_BLHQ, v_BLHV,
                                           spec.layer_kind(kind).window(spec),
                                           rules=spec.rules, segments_BL=segments_BL)
        return dense(spec, "blhk,hkd->bld", out_BLHV, self.w_o[...])

    def __call__(self, x_BLD: jax.Array, segments_BL=None, positions_BL=None) -> jax.Array:
        return self.attend(*self.qkv(x_BLD, positions_BL), segments_BL)

    def init_cache(self, batch: int, length: int, dtype) -> tuple:
        """The decoding cache: (c [B, M, kv_lora_rank], k_rope [B, M, rope]), zeros."""
        mla = self.mla
        return (jnp.zeros((batch, length, mla.kv_lora_rank), dtype),
                jnp.zeros((batch, length, mla.qk_rope_head_dim), dtype))

    def decode(self, x_BTD: jax.Array, cache: tuple, start: jax.Array, kind=None):
        """T new positions [start, start+T) against the latent cache, read as it is, with
        the up-projections absorbed (module docstring); returns (y_BTD, their latents and
        rotary keys [B, T, ...]), which the model writes into the cache after its last
        layer (models/attention/cache.py)."""
        spec, mla = self.spec, self.mla
        positions_xT = decode_cache.positions(start, x_BTD.shape[1])
        q_nope_BTHN, q_rope_BTHK = self._query(x_BTD, positions_xT)
        new = tuple(n.astype(c.dtype) for n, c in zip(self._latent(x_BTD, positions_xT), cache))
        dt = spec.compute_dtype
        q_lat_BTHR = jnp.einsum("bthn,rhn->bthr", q_nope_BTHN, self.w_k_up[...].astype(dt))
        window = spec.layer_kind(kind).window(spec)
        blocks = ((cache, decode_cache.visible_cached(positions_xT, cache[0].shape[1], window)),
                  (new, decode_cache.visible_new(positions_xT, window)))
        parts = []
        for (c_BMR, k_rope_BMK), visible_TM in blocks:  # the cache's, then the new tokens'
            scores_BHTM = (jnp.einsum("bthr,bmr->bhtm", q_lat_BTHR, c_BMR.astype(dt),
                                      preferred_element_type=jnp.float32)
                           + jnp.einsum("bthk,bmk->bhtm", q_rope_BTHK, k_rope_BMK.astype(dt),
                                        preferred_element_type=jnp.float32)) * mla.scale
            if positions_xT.ndim == 2:  # [B, T, M] per row, under the heads
                visible_TM = visible_TM[:, None]
            parts.append(jnp.where(visible_TM, scores_BHTM, jnp.finfo(jnp.float32).min))
        o_lat_BTHR = sum(jnp.einsum("bhtm,bmr->bthr", p_BHTM.astype(dt), c_BMR.astype(dt))
                         for p_BHTM, c_BMR in zip(decode_cache.joint_softmax(parts),
                                                  (cache[0], new[0])))
        out_BTHV = jnp.einsum("bthr,rhv->bthv", o_lat_BTHR, self.w_v_up[...].astype(dt))
        return dense(spec, "blhk,hkd->bld", out_BTHV, self.w_o[...]), new


MLA = AttentionPart(
    "mla", "multi-head latent attention: a shared compressed kv latent, decoupled rotary "
    "dims, a latent decoding cache", Mla, check,
    lambda m, dtype_bytes: m.cache_bytes_per_token(dtype_bytes),
    lambda m, d_model, heads: m.matmul_params(d_model, heads))
