"""The attention kernels (`model.attention`): causal self-attention with grouped-query
heads, an optional sliding window and optional document masks.

An attention kernel is a plain function (q, k, v, window, segments) -> out chosen by name,
so faster implementations plug in without touching the layer. window=None: full causal
attention; window=W: query position i sees keys (i - W, i] (W keys including itself, as
transformers' sliding_window).

Document masks (a batch layout with `segments`, data/layouts.py: documents, pairs;
docs/data.md): `segments_BL` is an int32 [B, L]
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

from jaxtrain.errors import fail
from jaxtrain.models.attention.chunked import chunked_attention, loop_tile
from jaxtrain.models.attention.cudnn import cudnn_attention
from jaxtrain.models.attention.pallas_gpu import pallas_attention
from jaxtrain.models.attention.splash import splash_attention
from jaxtrain.models.attention.xla import xla_attention


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
    segments: bool = True  # takes document masks (segment ids): data/layouts.py `segments`
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
    # Under mesh.context > 1 the context kernel (context.py) runs in its place: naming it
    # is accepted (it is an XLA kernel too); a custom kernel is refused.
    under_context: bool = False
    softcap: bool = False  # takes an attention-logit soft-cap (model.attn_logit_softcap)
    sinks: bool = False  # takes learned attention sinks, a logit per head (part 'sinks')

    def __call__(self, q_BLHK, k_BMGK, v_BMGK, window: int | None = None, rules=None,
                 segments_BL=None, softcap: float = 0.0, sinks=None):
        if segments_BL is not None and not self.segments:
            raise ValueError(f"the {self.name} attention kernel takes no document masks")
        extra = {} if segments_BL is None else {"segments_BL": segments_BL}
        if softcap:  # only then: the kernels without the part keep their signature
            if not self.softcap:
                raise ValueError(f"the {self.name} attention kernel has no logit soft-cap")
            extra["softcap"] = softcap
        if sinks is not None:  # as the soft-cap: only then
            if not self.sinks:
                raise ValueError(f"the {self.name} attention kernel has no attention sinks")
            extra["sinks"] = sinks
        if self.sharded_by_rules:
            extra["rules"] = rules
        return self.fn(q_BLHK, k_BMGK, v_BMGK, window, **extra)

    def check_mesh(self, c, sizes: dict[str, int]) -> None:
        """ConfigError when the mesh leaves this kernel out: under context parallelism."""
        if sizes.get("context", 1) > 1 and c.model.attn_logit_softcap:
            fail("model.attn_logit_softcap", c.model.attn_logit_softcap, "the context-parallel "
                 f"attention (mesh.context={sizes['context']}) cannot run the attention-logit "
                 "soft-cap part; use mesh.context=1")
        if sizes.get("context", 1) > 1 and not self.under_context:
            able = ", ".join(k.name for k in KERNELS.values() if k.under_context)
            fail("model.attention", c.model.attention, f"mesh.context={sizes['context']} "
                 "runs the context-parallel attention (XLA blocks, model.context_attention); "
                 f"use auto or {able}")

    def problem(self, precision: str, platform: str | None, seq_len: int,
                window: int, documents: bool = False, softcap: float = 0.0,
                parts: tuple[str, ...] = ()) -> str | None:
        """Why this kernel cannot run this config (None: it can); platform None: unknown
        yet (the planner), so only the platform-independent checks apply. parts: the
        capabilities the family's attention parts need (models/families.py kernel_parts)."""
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
                    "gives document masks); use " + ", ".join(k.name for k in KERNELS.values()
                                                     if k.segments))
        if softcap and not self.softcap:
            able = ", ".join(k.name for k in KERNELS.values() if k.softcap)
            return (f"the {self.name} kernel cannot run the attention-logit soft-cap part "
                    f"(model.attn_logit_softcap={softcap}); use {able}")
        for part in parts:
            if not getattr(self, part):
                able = ", ".join(k.name for k in KERNELS.values() if getattr(k, part))
                return (f"the {self.name} kernel cannot run the family's attention part "
                        f"{part!r}; use {able}")
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
                    under_context=True, sinks=True),
    AttentionKernel("xla", xla_attention, "the reference: full score matrix, mask, softmax",
                    ("cpu", "gpu", "tpu"), full_scores=True, under_context=True, softcap=True,
                    sinks=True),
)}


def resolve_attention(name: str, precision: str, platform: str, seq_len: int = 128,
                      window: int = 0, documents: bool = False, softcap: float = 0.0,
                      parts: tuple[str, ...] = ()) -> str:
    """The kernel `model.attention` names on this platform: 'auto' is the first kernel
    whose auto_on is the platform and that can run the config, else chunked; 'pallas' on
    a TPU is the splash kernel."""
    if name == "pallas" and platform == "tpu":
        return "splash"
    if name != "auto":
        return name
    for kernel in KERNELS.values():
        if kernel.auto_on == platform and not kernel.problem(precision, platform, seq_len,
                                                              window, documents, softcap,
                                                              parts):
            return kernel.name
    # Else chunked where it can run the config's parts (the sinks), xla (the soft-cap).
    fallback = KERNELS["chunked"].problem(precision, None, seq_len, window, documents,
                                          softcap, parts)
    return "xla" if fallback else "chunked"
