"""Model families: one registry entry per `model.family`, a composition of registered parts.

The model code reads a family's fields and parts (which norm, biases or not, rotary or
learned positions, tied embeddings, the MLP's kind, the attention's options) and never a
family's name, so a new family made of existing parts is one more entry here (plus, for
Hugging Face interop, a mapping module in jaxtrain/hf/).

An attention option (ATTENTION_PARTS) is one registry entry: the parameters it adds to
each attention layer, what it does to a projected q/k/v head tensor before the rotary
embedding (its function), the model shapes it refuses (its check) and its facts for the
planner (parameters and FLOPs per token per layer; none change the kv cache's size).

An MoE expert kind (EXPERT_KINDS, a family's `experts`) is one registry entry too: the
activation of each expert's gate and up projections and whether its projections and the
router's logits carry biases (their parameters: the planner counts no elementwise work).

A layer kind (LAYER_KINDS, `model.layer_types`) is one registry entry too: how a layer of
that kind attends (within model.sliding_window or to every earlier token) and rotates
(model.rope_local_theta or the model's rope), with its planner fact (the keys each query
sees: its attention FLOPs). The group walker (models/stack.py) scans runs of equal kinds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtrain.errors import fail
from jaxtrain.models.layers import rms_norm

MLP_KINDS = ("gelu", "swiglu", "geglu")  # geglu: tanh-GELU(gate)·up (Gemma)


def _swiglu(kind, gate, up):
    return jax.nn.silu(gate) * up


def _clamped_swiglu(kind, gate, up):
    """gpt-oss: the gate clipped above at `limit`, the up projection to ±limit, then
    (up + 1)·gate·sigmoid(alpha·gate)."""
    gate = jnp.minimum(gate, kind.limit)
    up = jnp.clip(up, -kind.limit, kind.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(kind.alpha * gate))


@dataclasses.dataclass(frozen=True)
class ExpertKind:
    """One value of a family's `experts`: what each routed expert computes."""

    name: str
    doc: str
    fn: Callable  # (kind, gate, up) -> the activation fed to the down projection
    # Biases on the experts' gate, up and down projections ([E, F], [E, F], [E, D]) and on
    # the router's logits ([E]), all born zero.
    bias: bool = False
    alpha: float = 1.0  # the sigmoid's gain (clamped SwiGLU)
    limit: float = 0.0  # the clamp (clamped SwiGLU)


EXPERT_KINDS: dict[str, ExpertKind] = {k.name: k for k in (
    ExpertKind("swiglu", "SiLU(gate)·up, no biases (Mixtral, Qwen3-MoE)", _swiglu),
    ExpertKind("swiglu_clamped", "gate ≤ 7, |up| ≤ 7, (up + 1)·gate·σ(1.702·gate); biases on "
               "the projections and the router's logits (gpt-oss)", _clamped_swiglu,
               bias=True, alpha=1.702, limit=7.0),
)}


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One value of model.layer_types: how the layers of this kind attend and rotate."""

    name: str
    doc: str
    hf_name: str  # transformers' layer_types value
    windowed: bool  # each query sees its last model.sliding_window keys; else every earlier
    # Rotates by model.rope_local_theta, unscaled, where that is set (Gemma 3's
    # rope_local_base_freq); else by model.rope_theta and model.rope_scaling as full layers.
    local_rope: bool
    # A Gated DeltaNet layer (models/linear_attention/): no softmax attention, no kv cache;
    # its parameters are stacked apart (`linear_blocks`), its cache a constant-size state.
    linear: bool = False

    def window(self, spec) -> int | None:
        """The kernels' window argument for this kind (None: full causal attention)."""
        return (spec.sliding_window or None) if self.windowed else None

    def rope(self, spec) -> tuple[float, object]:
        """(theta, RopeScaling or None) of this kind's rotary embedding."""
        if self.local_rope and spec.rope_local_theta:
            return spec.rope_local_theta, None
        return spec.rope_theta, spec.rope_scaling

    def keys_per_query(self, spec) -> float:
        """Planner: the keys a query sees on average: half the sequence under the causal
        mask; W - W²/2s within a window W (fewer in the first W positions)."""
        s, w = spec.seq_len, self.window(spec)
        if self.linear:
            return 0.0
        return s / 2 if not w or w >= s else w - w * w / (2 * s)


LAYER_KINDS: dict[str, LayerKind] = {k.name: k for k in (
    LayerKind("full", "attends to every earlier token", "full_attention", False, False),
    LayerKind("sliding", "attends to its last model.sliding_window tokens (Mistral, Gemma "
              "2/3's local layers)", "sliding_attention", True, True),
    LayerKind("linear_attention", "a Gated DeltaNet layer: the gated delta rule over a "
              "recurrent state, chunked in training (model.linear_attention) (Qwen3.5, "
              "Qwen3-Next)", "linear_attention", False, False, linear=True),
)}
# model.layer_types unset: every layer is this kind, whose window is model.sliding_window
# (0: none) and whose rope is the model's: the one-kind models as before the pattern.
UNIFORM = LayerKind("uniform", "every layer alike: model.sliding_window if set", "", True,
                    False)


def layer_pattern(value: str, num_layers: int) -> tuple[str, ...]:
    """model.layer_types as one kind per layer: () when unset (every layer UNIFORM); a
    shorter list repeats (Gemma 3's sliding×5,full is 'sliding,sliding,sliding,sliding,
    sliding,full' over any depth, as transformers' sliding_window_pattern); ConfigError (one
    line) for an unknown kind or a longer list."""
    kinds = tuple(k.strip() for k in str(value).split(",") if k.strip())
    if not kinds:
        return ()
    if unknown := [k for k in kinds if k not in LAYER_KINDS]:
        fail("model.layer_types", value, f"{unknown[0]!r} is no layer kind: valid kinds are "
             f"{', '.join(LAYER_KINDS)}, comma-separated")
    if len(kinds) > num_layers:
        fail("model.layer_types", value, f"names {len(kinds)} layers, more than "
             f"model.num_layers={num_layers}")
    return tuple(kinds[i % len(kinds)] for i in range(num_layers))


def check_layer_pattern(m) -> None:
    """ConfigError for a model.layer_types the model cannot run (config.validate)."""
    kinds = layer_pattern(m.layer_types, m.num_layers)
    if any(LAYER_KINDS[k].windowed for k in kinds) and m.sliding_window < 1:
        fail("model.layer_types", m.layer_types, "has sliding layers: set model.sliding_window "
             "to their window (>= 1)")
    if m.rope_local_theta < 0:
        fail("model.rope_local_theta", m.rope_local_theta, "must be > 0, or 0 for the sliding "
             "layers to rotate as the full ones")
    if m.moe.num_experts and len(set(kinds)) > 1:
        n = m.moe.every_n_layers
        mixed = [g for g in range(m.num_layers // n) if len(set(kinds[g * n:(g + 1) * n])) > 1]
        if mixed:
            fail("model.layer_types", m.layer_types, f"mixes kinds within MoE group {mixed[0]} "
                 f"(layers {mixed[0] * n}..{mixed[0] * n + n - 1}, model.moe.every_n_layers="
                 f"{n}): each group of n layers must be of one kind")


def linear_layers(m) -> bool:
    """Whether some layer of cfg.model `m` is a linear-attention layer."""
    return any(LAYER_KINDS[k].linear for k in layer_pattern(m.layer_types, m.num_layers))


def pattern_window(m) -> int:
    """The window the attention kernel must take for this config: model.sliding_window
    when some layer is windowed (0: none), for the kernels' checks."""
    kinds = layer_pattern(m.layer_types, m.num_layers)
    if kinds and not any(LAYER_KINDS[k].windowed for k in kinds):
        return 0
    return m.sliding_window


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


def _sinks_params(spec) -> dict[str, tuple]:
    return {"sinks": ((spec.num_heads,), ("heads",), 0.0)}


def _output_gate_params(spec) -> dict[str, tuple]:
    return {"w_gate": ((spec.d_model, spec.num_heads, spec.head_dim),
                       ("embed", "heads", "kv"), spec.init_std)}


def _unchanged(module, which: str, y_BLHK, spec):
    """A part that acts inside the kernel leaves the projections as they are."""
    return y_BLHK


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
    # The kernel capability it needs (an AttentionKernel field of that name, which kernels
    # without it refuse in one line); its parameter of that name goes to the kernel.
    kernel: str | None = None

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
    AttentionPart("sinks", "a learned logit per head that joins every query's softmax and "
                  "takes its share of the probability, with no value (gpt-oss)",
                  _sinks_params, _unchanged, lambda s: 3 * s.num_heads, kernel="sinks"),
    AttentionPart("output_gate", "the attention's output times σ(x·W_gate), per head and "
                  "feature, before the output projection (Qwen3.5, Qwen3-Next)",
                  _output_gate_params, _unchanged,
                  lambda s: (2 * s.d_model + 4) * s.num_heads * s.head_dim,
                  kept_per_token=lambda s: 2 * s.num_heads * s.head_dim),
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
    # The EXPERT_KINDS entry its MoE layers (model.moe) run; "": the family takes no experts
    experts: str = ""
    # It has dense feed-forward layers; False: every layer is MoE (gpt-oss), so
    # model.moe.num_experts must be set and model.moe.every_n_layers 1.
    dense_mlp: bool = True

    def __post_init__(self):
        unknown = [p for p in self.attention if p not in ATTENTION_PARTS]
        assert not unknown, f"family {self.name}: unknown attention parts {unknown}"
        assert not self.experts or self.experts in EXPERT_KINDS, self.experts

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
        """MoE layers (models/moe.py) fit it: it names their expert kind."""
        return bool(self.experts)

    @property
    def expert_kind(self) -> ExpertKind:
        return EXPERT_KINDS[self.experts or "swiglu"]

    @property
    def attention_parts(self) -> tuple[AttentionPart, ...]:
        return tuple(ATTENTION_PARTS[p] for p in self.attention)

    @property
    def kernel_parts(self) -> tuple[str, ...]:
        """The kernel capabilities its attention parts need (AttentionPart.kernel)."""
        return tuple(p.kernel for p in self.attention_parts if p.kernel)

    def check(self, head_dim: int) -> None:
        """Raises ConfigError for a model shape this family cannot take."""
        if self.rope and head_dim % 2:
            fail("model.head_dim", head_dim, "RoPE needs an even head_dim")
        for part in self.attention_parts:
            if part.check is not None:
                part.check(self, head_dim)


_LLAMA = dict(norm="rms", bias=False, rope=True, tied_embeddings=False, mlp="swiglu",
              experts="swiglu")

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
    Family("deepseek_v3", "DeepSeek-V3: Llama's norms, SwiGLU and RoPE; its attention is "
           "model.mla (latent), its MoE router model.moe.router (sigmoid_bias) with shared "
           "experts and a dense prefix", **_LLAMA),
    Family("mistral4", "Mistral 4: DeepSeek-V3's parts; its router model.moe.router "
           "(softmax_group)", **_LLAMA),
    Family("gpt_oss", "gpt-oss: Llama's norms and RoPE, biases on q, k, v and o, attention "
           "sinks, every layer MoE with clamped-SwiGLU experts and a router bias", norm="rms",
           bias=True, rope=True, tied_embeddings=False, mlp="swiglu", attention=("sinks",),
           experts="swiglu_clamped", dense_mlp=False),
    Family("qwen3_5_text", "Qwen3.5 text (dense): (1 + w) RMSNorm, SwiGLU, gated "
           "full-attention layers with (1 + w) q/k norms and partial RoPE "
           "(model.partial_rotary_factor) between Gated DeltaNet layers (model.layer_types "
           "linear_attention)", norm="rms", bias=False, rope=True, tied_embeddings=False,
           mlp="swiglu", attention=("qk_norm", "output_gate"), norm_offset=1.0),
)}

