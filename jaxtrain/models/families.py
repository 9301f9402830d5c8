"""Model families: one registry entry per `model.family`, a composition of registered parts.

The model code reads a family's fields and parts (which norm, biases or not, rotary or
learned positions, tied embeddings, the MLP's kind, the attention's options) and never a
family's name, so a new family made of existing parts is one more entry here (plus, for
Hugging Face interop, a mapping module in jaxtrain/hf/).

An attention option (ATTENTION_PARTS) is one registry entry: the parameters it adds to
each attention layer, what it does to a projected q/k/v head tensor before the rotary
embedding (its function), the model shapes it refuses (its check) and its facts for the
planner (parameters and FLOPs per token per layer; none change the kv cache's size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxtrain.errors import fail
from jaxtrain.models.layers import rms_norm

MLP_KINDS = ("gelu", "swiglu", "geglu")  # geglu: tanh-GELU(gate)·up (Gemma)


def _qkv_bias_params(spec) -> dict[str, tuple]:
    h, g, k = spec.num_heads, spec.num_kv_heads, spec.head_dim
    return {"b_q": ((h, k), ("heads", "kv"), 0.0), "b_k": ((g, k), ("kv_heads", "kv"), 0.0),
            "b_v": ((g, k), ("kv_heads", "kv"), 0.0)}


def _qkv_bias(module, which: str, y_BLHK, spec):
    """Adds the projection's bias. Unlike GPT-2's key bias (a constant per query's scores,
    which softmax ignores), this one is rotated with the key and so changes the scores."""
    return y_BLHK + getattr(module, f"b_{which}")[...].astype(y_BLHK.dtype)


def _qk_norm_params(spec) -> dict[str, tuple]:
    init = 0.0 if spec.norm_offset else None  # the family's norms: weight, or offset + weight
    return {"q_norm": ((spec.head_dim,), ("kv",), init),
            "k_norm": ((spec.head_dim,), ("kv",), init)}


def _qk_norm(module, which: str, y_BLHK, spec):
    """RMSNorm of each query and key head over head_dim (statistics in float32, the
    block norms' closed-form backward), before the rotary embedding; values stay as
    projected."""
    if which == "v":
        return y_BLHK
    scale = getattr(module, f"{which}_norm")[...]
    if spec.norm_offset:
        scale = spec.norm_offset + scale
    return rms_norm(y_BLHK, scale, spec.norm_eps)


@dataclasses.dataclass(frozen=True)
class AttentionPart:
    """One attention option a family can switch on."""

    name: str
    doc: str
    params: Callable  # spec -> {name: (shape, logical axes, init std: None ones, 0.0 zeros)}
    fn: Callable  # (attention module, 'q'|'k'|'v', y_BLHK, spec) -> y_BLHK, before RoPE
    # Planner: FLOPs per token per layer of its function (forward), from the spec.
    flops_per_token: Callable = lambda spec: 0
    check: Callable | None = None  # (family, head_dim) -> None, ConfigError when refused
    # Planner: values per token per layer the backward pass keeps for its function (the
    # memory estimate, plan/memory.py), summed over heads before any tensor sharding.
    kept_per_token: Callable = lambda spec: 0

    def param_count(self, spec) -> int:
        """Planner: the parameters it adds to one layer."""
        count = 0
        for shape, _, _ in self.params(spec).values():
            n = 1
            for s in shape:
                n *= s
            count += n
        return count


def _no_full_bias(family, head_dim: int) -> None:
    if family.bias:
        fail("model.family", family.name, "its projections already have biases (bias=True); "
             "qkv_bias is for families without")


ATTENTION_PARTS: dict[str, AttentionPart] = {p.name: p for p in (
    AttentionPart("qkv_bias", "biases on the q, k and v projections, none on the output "
                  "(Qwen2.5)", _qkv_bias_params, _qkv_bias,
                  lambda s: (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, _no_full_bias),
    AttentionPart("qk_norm", "RMSNorm of each q and k head over head_dim before RoPE "
                  "(Qwen3, OLMo 2, Gemma 3)", _qk_norm_params, _qk_norm,
                  lambda s: 4 * (s.num_heads + s.num_kv_heads) * s.head_dim,
                  kept_per_token=lambda s: (s.num_heads + s.num_kv_heads) * s.head_dim),
)}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    doc: str
    norm: str  # "layer" (centred, with bias) or "rms"
    bias: bool  # biases on the attention and MLP projections
    rope: bool  # rotary position embeddings; else learned absolute positions
    tied_embeddings: bool  # the output head is the token embedding table
    mlp: str  # one of MLP_KINDS: "gelu" (up, GELU, down), "swiglu" (SiLU(gate)·up, down),
    # "geglu" (tanh-GELU(gate)·up, down)
    attention: tuple[str, ...] = ()  # ATTENTION_PARTS names, applied in this order
    # RMSNorm's scale is offset + weight (Gemma: 1 + weight, the weight born zero); 0: weight
    norm_offset: float = 0.0
    # Sandwich norms (Gemma 2/3): each sub-layer's output normed again before its residual
    sandwich: bool = False
    embed_scale: bool = False  # the token embeddings times sqrt(d_model) (Gemma)

    def __post_init__(self):
        unknown = [p for p in self.attention if p not in ATTENTION_PARTS]
        assert not unknown, f"family {self.name}: unknown attention parts {unknown}"

    @property
    def gated_mlp(self) -> bool:
        return self.mlp in ("swiglu", "geglu")

    def kept_per_token(self, d_model: int) -> int:
        """Planner: values per token per layer the backward pass keeps beyond a Llama
        layer's: the sandwich norms' two inputs (tanh-GELU keeps no more than SiLU: fitted
        on configs/tiny_gemma3.py)."""
        return 2 * d_model * self.sandwich

    @property
    def takes_experts(self) -> bool:
        """MoE layers (models/moe.py) fit it: their experts are SwiGLU without biases."""
        return self.mlp == "swiglu" and not self.bias

    @property
    def attention_parts(self) -> tuple[AttentionPart, ...]:
        return tuple(ATTENTION_PARTS[p] for p in self.attention)

    def check(self, head_dim: int) -> None:
        """Raises ConfigError for a model shape this family cannot take."""
        if self.rope and head_dim % 2:
            fail("model.head_dim", head_dim, "RoPE needs an even head_dim")
        for part in self.attention_parts:
            if part.check is not None:
                part.check(self, head_dim)


_LLAMA = dict(norm="rms", bias=False, rope=True, tied_embeddings=False, mlp="swiglu")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt2", "GPT-2: LayerNorm, GELU, biases, learned positions, tied embeddings",
           norm="layer", bias=True, rope=False, tied_embeddings=True, mlp="gelu"),
    Family("llama", "Llama: RMSNorm, SwiGLU, no biases, RoPE, separate output head",
           **_LLAMA),
    Family("mistral", "Mistral: Llama's parts; its sliding window is model.sliding_window",
           **_LLAMA),
    Family("qwen2", "Qwen2/2.5: Llama's parts with q, k, v biases", **_LLAMA,
           attention=("qkv_bias",)),
    Family("qwen3", "Qwen3 dense: Llama's parts with per-head q/k RMSNorm", **_LLAMA,
           attention=("qk_norm",)),
    Family("gemma3", "Gemma 3 text: (1 + w) RMSNorm, sandwich norms, q/k norm, GeGLU, "
           "sqrt(d) embedding scale, tied head", norm="rms", bias=False, rope=True,
           tied_embeddings=True, mlp="geglu", attention=("qk_norm",), norm_offset=1.0,
           sandwich=True, embed_scale=True),
    Family("gemma2", "Gemma 2: Gemma 3's parts without the q/k norm (its soft-caps are "
           "model.attn_logit_softcap)", norm="rms", bias=False, rope=True,
           tied_embeddings=True, mlp="geglu", norm_offset=1.0, sandwich=True,
           embed_scale=True),
)}

