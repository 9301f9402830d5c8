"""Causal self-attention with grouped-query heads, an optional sliding window and optional
document masks.

The attention kernel is a plain function (q, k, v, window, segments) -> out chosen by name,
so faster implementations plug in without touching the module. window=None: full causal
attention; window=W: query position i sees keys (i - W, i] (W keys including itself, as
Mistral's sliding_window).

Document masks (data.packing='documents', docs/data.md): `segments_BL` is an int32 [B, L]
array, the document of each position of a packed row (1, 2, ... in row order; 0 for the
padding at the row's end, which is one more segment and attends only to itself). A query
sees a key only when both hold the same id, on top of the causal (and window) mask; None is
one document per row, the plain causal kernel, unchanged. The ids of a document are one
contiguous run (cuDNN's packed layout relies on it; the other kernels compare ids). Kernels
take one array because this is self-attention: queries and keys have the same positions.
A kernel that tiles the sequence over devices (context parallelism) slices it like the
queries for the query side and passes the key side's slice with the keys it holds, as
splash's `SegmentIds(q, kv)` and the chunked kernel's per-chunk `_segment_bias` do.
Positions restart at each document (`positions_BL`, for RoPE and learned positions); the
model reads them, the kernels never do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.errors import fail
from jaxtrain.mesh import constrain
from jaxtrain.models import lora
from jaxtrain.models.attention.chunked import chunked_attention, loop_tile
from jaxtrain.models.attention.context import context_attention
from jaxtrain.models.attention.cudnn import cudnn_attention
from jaxtrain.models.attention.splash import splash_attention
from jaxtrain.models.layers import dense, param
from jaxtrain.models.rope import rope


def causal_mask(query_pos, key_pos, window: int | None):
    """Bool [..., Q, M]: which keys each query sees (causal, within the window)."""
    visible = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - window
    return visible


def same_document(q_segments_BT, kv_segments_BM):
    """Bool [B, T, M]: whether each query and key are of one document."""
    return q_segments_BT[:, :, None] == kv_segments_BM[:, None, :]


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
                     segments_BL=None):
    """T queries at positions_T against M keys at positions 0..M-1: full score matrix, mask,
    float32 softmax. When decoding, the keys are a cache whose slots past each query's
    position are unwritten; the causal mask hides them. segments_BL (self-attention, T = M):
    the document masks of the module docstring."""
    b, t, heads, head_dim = q_BTHK.shape
    groups = k_BMGK.shape[2]
    q_BTGRK = q_BTHK.reshape(b, t, groups, heads // groups, head_dim)
    scores_BGRTM = _scores(q_BTGRK, k_BMGK)
    visible_TM = causal_mask(positions_T, jnp.arange(k_BMGK.shape[1]), window)
    if segments_BL is not None:
        visible_TM = (visible_TM & same_document(segments_BL, segments_BL))[:, None, None]
    scores_BGRTM = jnp.where(visible_TM, scores_BGRTM, jnp.finfo(jnp.float32).min)
    probs_BGRTM = jax.nn.softmax(scores_BGRTM, axis=-1).astype(v_BMGK.dtype)
    out_BTGRK = jnp.einsum("bgrtm,bmgk->btgrk", probs_BGRTM, v_BMGK)
    return out_BTGRK.reshape(b, t, heads, head_dim)


def xla_attention(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array,
                  window: int | None = None, segments_BL=None) -> jax.Array:
    """Reference causal attention."""
    return cached_attention(q_BLHK, k_BMGK, v_BMGK, jnp.arange(q_BLHK.shape[1]), window,
                            segments_BL)


def pallas_attention(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array,
                     window: int | None = None, segments_BL=None) -> jax.Array:
    """jax's Pallas flash-attention kernel for GPUs (Triton); interpreted on CPU, for tests.
    It takes segment ids ([B, L], compared per block) for document masks.

    The kernel wants as many kv heads as query heads, so grouped kv heads are repeated. It
    has no sliding window (its KERNELS entry says so, and config.validate refuses that
    combination before anything compiles).
    """
    if window is not None:
        raise ValueError("the Pallas GPU attention kernel has no sliding window")
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    heads, groups, length = q_BLHK.shape[2], k_BMGK.shape[2], q_BLHK.shape[1]
    if groups != heads:
        k_BMGK = jnp.repeat(k_BMGK, heads // groups, axis=2)
        v_BMGK = jnp.repeat(v_BMGK, heads // groups, axis=2)
    block = next(b for b in (128, 64, 32, 16, 8, 4, 2, 1) if length % b == 0)
    blocks = pallas_gpu.BlockSizes(block_q=block, block_k=block, block_q_dkv=block,
                                   block_kv_dkv=block, block_q_dq=block, block_kv_dq=block)
    return pallas_gpu.mha(q_BLHK, k_BMGK, v_BMGK, segments_BL, sm_scale=1.0, causal=True,
                          block_sizes=blocks, interpret=jax.default_backend() == "cpu")


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """One `model.attention` value: the kernel, where it runs, what it supports (checked
    before anything compiles) and what the planner needs to know about it."""

    name: str
    fn: Callable  # (q_BLHK scaled, k_BMGK, v_BMGK, window, segments_BL) -> out_BLHK, causal
    doc: str
    platforms: tuple[str, ...]  # where it runs
    interpreted: tuple[str, ...] = ()  # of those, where it runs in an interpreter (tests)
    float32: bool = True  # runs in float32 (else 16-bit compute only)
    window: bool = True  # takes a sliding window
    segments: bool = True  # takes document masks (segment ids), for data.packing=documents
    seq_multiple: int = 1  # the sequence length must be a multiple of this
    auto_on: str | None = None  # 'auto' picks it first on this platform, where it applies
    # Planner: the whole L×L score matrix exists (and, without remat, is kept for the
    # backward pass); else a flash-style kernel that keeps only per-row statistics.
    full_scores: bool = False
    # Planner: rows of the query chunks whose float32 scores against their keys XLA forms
    # (0: none outside the kernel); its unrolled loop keeps several chunks' alive at once.
    query_chunk: int = 0
    # Planner: (seq_len, query_chunk) -> key columns of the [query chunk, key] float32 tile
    # a looped form keeps instead (0: it unrolls at this length); None: never loops.
    loop_tile: Callable | None = None
    sharded_by_rules: bool = False  # a custom call that shards itself by the logical rules
    # Under mesh.context > 1 the context kernel (models/context_attention.py) runs in its
    # place: naming it is accepted (it is an XLA kernel too); a custom kernel is refused.
    under_context: bool = False

    def __call__(self, q_BLHK, k_BMGK, v_BMGK, window: int | None = None, rules=None,
                 segments_BL=None):
        if segments_BL is not None and not self.segments:
            raise ValueError(f"the {self.name} attention kernel takes no document masks")
        extra = {} if segments_BL is None else {"segments_BL": segments_BL}
        if self.sharded_by_rules:
            extra["rules"] = rules
        return self.fn(q_BLHK, k_BMGK, v_BMGK, window, **extra)

    def check_mesh(self, c, sizes: dict[str, int]) -> None:
        """ConfigError when the mesh leaves this kernel out: under context parallelism."""
        if sizes.get("context", 1) > 1 and not self.under_context:
            able = ", ".join(k.name for k in KERNELS.values() if k.under_context)
            fail("model.attention", c.model.attention, f"mesh.context={sizes['context']} "
                 "runs the context-parallel attention (XLA blocks, model.context_attention); "
                 f"use auto or {able}")

    def problem(self, precision: str, platform: str | None, seq_len: int,
                window: int, documents: bool = False) -> str | None:
        """Why this kernel cannot run this config (None: it can); platform None: unknown
        yet (the planner), so only the platform-independent checks apply."""
        if platform is not None and platform not in self.platforms:
            return (f"it runs on {' and '.join(self.platforms)}, and this run has "
                    f"{platform} devices; use xla or chunked")
        if not self.float32 and precision == "float32":
            return ("it needs train.precision=bfloat16 (or float16/fp8); use xla or chunked "
                    "for float32")
        if window and not self.window:
            return f"it has no sliding window (model.sliding_window={window}); use cudnn or chunked"
        if documents and not self.segments:
            return ("it cannot mask attention at document boundaries (data.packing="
                    "'documents'); use " + ", ".join(k.name for k in KERNELS.values()
                                                     if k.segments))
        if seq_len % self.seq_multiple:
            return (f"it tiles the sequence in blocks of {self.seq_multiple}: model.seq_len="
                    f"{seq_len} is not a multiple")
        return None


# Registry order is 'auto''s order of preference where auto_on matches the platform;
# chunked is the fallback (it beats the reference on every backend measured).
KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (
    AttentionKernel("splash", splash_attention, "jax's Pallas splash kernel for TPUs",
                    ("tpu", "cpu"), ("cpu",), seq_multiple=128, auto_on="tpu",
                    sharded_by_rules=True),
    AttentionKernel("cudnn", cudnn_attention, "cuDNN's fused flash attention", ("gpu",),
                    float32=False, auto_on="gpu"),
    AttentionKernel("pallas", pallas_attention, "jax's Pallas (Triton) flash kernel for "
                    "GPUs; 'pallas' on TPU means splash", ("gpu", "cpu"), ("cpu",),
                    window=False),
    AttentionKernel("chunked", chunked_attention, "flash-style causal attention in XLA: "
                    "query chunks, skipped masked blocks, no L×L buffers kept",
                    ("cpu", "gpu", "tpu"), query_chunk=128, loop_tile=loop_tile,
                    under_context=True),
    AttentionKernel("xla", xla_attention, "the reference: full score matrix, mask, softmax",
                    ("cpu", "gpu", "tpu"), full_scores=True, under_context=True),
)}


def resolve_attention(name: str, precision: str, platform: str, seq_len: int = 128,
                      window: int = 0, documents: bool = False) -> str:
    """The kernel `model.attention` names on this platform: 'auto' is the first kernel
    whose auto_on is the platform and that can run the config, else chunked; 'pallas' on
    a TPU is the splash kernel."""
    if name == "pallas" and platform == "tpu":
        return "splash"
    if name != "auto":
        return name
    for kernel in KERNELS.values():
        if kernel.auto_on == platform and not kernel.problem(precision, platform, seq_len,
                                                              window, documents):
            return kernel.name
    return "chunked"


# Names of the tensors remat policies can keep (models/remat.py).
PROJECTION_NAMES = {"q": "query_proj", "k": "key_proj", "v": "value_proj"}
ATTENTION_DOT_NAMES = ("query_proj", "key_proj", "value_proj", "attention_out", "out_proj")


class Attention(nnx.Module):
    def __init__(self, spec, *, rngs: nnx.Rngs):
        self.spec = spec
        d, h, g, k = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim
        std, dt = spec.init_std, spec.param_dtype
        out_std = spec.init_std / (2 * spec.num_layers) ** 0.5
        self.w_q = param(rngs, (d, h, k), ("embed", "heads", "kv"), std, dt)
        self.w_k = param(rngs, (d, g, k), ("embed", "kv_heads", "kv"), std, dt)
        self.w_v = param(rngs, (d, g, k), ("embed", "kv_heads", "kv"), std, dt)
        self.w_o = param(rngs, (h, k, d), ("heads", "kv", "embed"), out_std, dt)
        if spec.use_bias:
            self.b_q = param(rngs, (h, k), ("heads", "kv"), 0.0, dt)
            self.b_k = param(rngs, (g, k), ("kv_heads", "kv"), 0.0, dt)
            self.b_v = param(rngs, (g, k), ("kv_heads", "kv"), 0.0, dt)
            self.b_o = param(rngs, (d,), ("embed",), 0.0, dt)
        # After every base weight, so that the base draws the same numbers with or without.
        for name in ("q", "k", "v", "o"):
            setattr(self, f"lora_{name}", lora.adapter(
                spec, "attention", getattr(self, f"w_{name}"), f"w_{name}", 2 if name == "o"
                else 1, rngs))

    def _project(self, x_BLD, name: str, axes) -> jax.Array:
        dt = self.spec.compute_dtype
        w = lora.weight(self.spec, getattr(self, f"w_{name}")[...],
                        getattr(self, f"lora_{name}"))
        y = dense(self.spec, "bld,dhk->blhk", x_BLD, w)
        # The key bias adds q·b_k to every score of a query, which softmax ignores: skipping
        # it keeps its gradient exactly zero rather than float noise that Adam would amplify.
        # The parameter stays, for checkpoints converted from Hugging Face GPT-2.
        if self.spec.use_bias and name != "k":
            y = y + getattr(self, f"b_{name}")[...].astype(dt)
        y = checkpoint_name(y, PROJECTION_NAMES[name])
        return constrain(y, ("batch", "length") + axes, self.spec.rules)

    def qkv(self, x_BLD, positions_L=None):
        """Projected q (scaled by 1/√head_dim), k and v of the normed input; positions_L
        ([L], or [B, L] restarting at each document) for rotary embeddings (default
        0..L-1)."""
        spec = self.spec
        q_BLHK = self._project(x_BLD, "q", ("heads", "kv"))
        k_BLGK = self._project(x_BLD, "k", ("kv_heads", "kv"))
        v_BLGK = self._project(x_BLD, "v", ("kv_heads", "kv"))
        if spec.rope:
            q_BLHK = rope(q_BLHK, spec.rope_theta, positions_L, spec.rope_scaling)
            k_BLGK = rope(k_BLGK, spec.rope_theta, positions_L, spec.rope_scaling)
        q_BLHK = q_BLHK * jnp.asarray(spec.head_dim ** -0.5, q_BLHK.dtype)
        return q_BLHK, k_BLGK, v_BLGK

    def _output(self, out_BLHK):
        spec = self.spec
        out_BLHK = checkpoint_name(out_BLHK, "attention_out")
        out_BLHK = constrain(out_BLHK, ("batch", "length", "heads", "kv"), spec.rules)
        y_BLD = dense(spec, "blhk,hkd->bld", out_BLHK,
                      lora.weight(spec, self.w_o[...], self.lora_o))
        if spec.use_bias:
            y_BLD = y_BLD + self.b_o[...].astype(spec.compute_dtype)
        return checkpoint_name(y_BLD, "out_proj")

    def __call__(self, x_BLD: jax.Array, segments_BL=None, positions_BL=None) -> jax.Array:
        return self.attend(*self.qkv(x_BLD, positions_BL), segments_BL)

    def attend(self, q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array,
               segments_BL=None) -> jax.Array:
        """The attention kernel and the output projection, from projected q, k, v;
        segments_BL: document masks (the module docstring), None for none."""
        spec, window = self.spec, self.spec.sliding_window or None
        if spec.context is not None:  # the sequence is split: the kernel passes K/V around
            out_BLHK = context_attention(q_BLHK, k_BLGK, v_BLGK, window, segments_BL,
                                         spec.context, spec.rules)
        else:
            out_BLHK = KERNELS[spec.attention](q_BLHK, k_BLGK, v_BLGK, window,
                                               rules=spec.rules, segments_BL=segments_BL)
        return self._output(out_BLHK)

    def decode(self, x_BTD: jax.Array, cache: tuple, start: jax.Array):
        """T new positions [start, start+T) against the kv cache ([B, M, G, K] each), which
        gets their keys and values; returns (y_BTD, cache)."""
        positions_T = start + jnp.arange(x_BTD.shape[1])
        q_BTHK, k_BTGK, v_BTGK = self.qkv(x_BTD, positions_T)
        k_BMGK, v_BMGK = (jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, 1)
                          for c, new in zip(cache, (k_BTGK, v_BTGK)))
        out_BTHK = cached_attention(q_BTHK, k_BMGK, v_BMGK, positions_T,
                                    self.spec.sliding_window or None)
        return self._output(out_BTHK), (k_BMGK, v_BMGK)
