"""Gemma3ForCausalLM (model_type gemma3_text) <-> jaxtrain's gemma3 family, and
Gemma2ForCausalLM (gemma2) <-> gemma2 (the same parts without the q/k norm).

Llama's projection layouts (llama.py); the norms are Gemma's (1 + w) RMSNorm, stored as w on
both sides: `input_layernorm` -> attn_norm, `post_attention_layernorm` -> post_attn_norm
(the sandwich norm on the attention's output, not Llama's pre-MLP norm),
`pre_feedforward_layernorm` -> mlp_norm, `post_feedforward_layernorm` -> post_mlp_norm,
`self_attn.{q,k}_norm` -> q_norm/k_norm. The head is the embedding table (tied; the
checkpoint has no lm_head). q·k is scaled by query_pre_attn_scalar**-0.5
(model.attention_scale_dim), the embeddings by sqrt(hidden_size).

Gemma 2's `attn_logit_softcapping` (null: none) is model.attn_logit_softcap (0), both
ways; Gemma 3's config carries the key but transformers' Gemma 3 never applies it, so a
value there is refused rather than silently dropped or applied. `final_logit_softcapping`
(null: none) is model.final_logit_softcap (0), both ways.

`layer_types` (absent: Gemma 3's 5 sliding : 1 full, `sliding_window_pattern`; Gemma 2's
alternating) and `sliding_window` are model.layer_types and model.sliding_window, both
ways (hf/layer_types.py). Gemma 3's sliding layers rotate by
`rope_parameters.sliding_attention.rope_theta` (the older `rope_local_base_freq`), which is
model.rope_local_theta (0: rope_theta); Gemma 2's rotate as its full ones. A rope scaling
(Gemma 3's full layers' `linear`) is refused.
"""

from __future__ import annotations

import dataclasses

from jaxtrain.errors import ConfigError
from jaxtrain.hf import layer_types, llama
from jaxtrain.hf.mapping import Checks, HFTensor, linear, one, split_heads

LAYER = llama.LAYER


def _full_theta(hf: dict) -> float:
    """The full-attention layers' theta: rope_parameters by layer type (Gemma 3), or one."""
    rope = hf.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    return float(rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))


def _sliding_theta(hf: dict) -> float:
    """Gemma 3's sliding layers' theta (transformers' default 10,000)."""
    rope = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    return float(rope.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))


def _types(self, hf: dict) -> list[str]:
    """transformers' layer_types of this config.json: given, or its family's default."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    every = hf.get("sliding_window_pattern", 6) if self.rope_by_layer_type else 2
    return ["sliding_attention" if (i + 1) % every else "full_attention"
            for i in range(hf.get("num_hidden_layers", 26))]


def _check_layer_types(self, c: Checks, hf: dict, m) -> None:
    layer_types.check(c, m, hf, _types(self, hf), "layer_types/sliding_window")
    if self.rope_by_layer_type:
        c.derive("model.rope_local_theta", _sliding_theta(hf))
    theta = layer_types.windowed_theta(m)
    want = _sliding_theta(hf) if self.rope_by_layer_type else m.rope_theta
    if theta is not None and theta != want:
        c.problems.append(f"model.rope_local_theta={m.rope_local_theta} (0: rope_theta) gives "
                          f"the sliding layers theta {theta} but config.json gives {want}")


def _check_config(self, hf: dict, m) -> list[str]:
    """Disagreements of the config.json with cfg.model `m`, one message each."""
    c = Checks()
    d, heads = hf.get("hidden_size", 2304), hf.get("num_attention_heads", 8)
    for ours, key, theirs in (
            ("model.d_model", "hidden_size", d), ("model.num_heads", "num_attention_heads", heads),
            ("model.num_layers", "num_hidden_layers", hf.get("num_hidden_layers", 26)),
            ("model.mlp_dim", "intermediate_size", hf.get("intermediate_size", 9216)),
            ("model.vocab_size", "vocab_size", hf.get("vocab_size", 262208)),
            ("model.norm_eps", "rms_norm_eps", hf.get("rms_norm_eps", 1e-6))):
        c.equal(ours, m[ours.split(".")[1]], key, theirs)
    c.equal("model.num_kv_heads", m.num_kv_heads or m.num_heads, "num_key_value_heads",
            hf.get("num_key_value_heads", 4))
    head_dim = hf.get("head_dim", 256)
    c.equal("model.head_dim", m.head_dim or m.d_model // m.num_heads, "head_dim", head_dim)
    c.equal("model.attention_scale_dim (0: head_dim)", m.attention_scale_dim or head_dim,
            "query_pre_attn_scalar", hf.get("query_pre_attn_scalar", 256))
    c.equal("model.rope_theta", m.rope_theta, "rope_parameters.full_attention.rope_theta",
            _full_theta(hf))
    if m.rope_scaling.type != "none":
        c.problems.append(f"model.rope_scaling.type={m.rope_scaling.type!r}: gemma3_text's "
                          "scaling is not mapped (use none)")
    _check_layer_types(self, c, hf, m)
    rope = hf.get("rope_parameters") or {}
    for kind, params in (rope.items() if self.rope_by_layer_type else [("", rope)]):
        if (params or {}).get("rope_type", "default") != "default":
            c.refuse(f"rope_parameters{'.' * bool(kind)}{kind}.rope_type", params["rope_type"],
                     "jaxtrain maps no rope scaling for Gemma (the theta alone)")
    if self.softcap:
        c.equal("model.attn_logit_softcap (0: none)", m.attn_logit_softcap,
                "attn_logit_softcapping (null: none)", hf.get("attn_logit_softcapping") or 0.0)
    elif hf.get("attn_logit_softcapping"):
        c.refuse("attn_logit_softcapping", hf["attn_logit_softcapping"],
                 f"transformers' {self.ARCHITECTURE} never applies it (remove the key)")
    c.equal("model.final_logit_softcap (0: none)", m.final_logit_softcap,
            "final_logit_softcapping (null: none)", hf.get("final_logit_softcapping") or 0.0)
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        c.refuse("hidden_activation", hf["hidden_activation"], "jaxtrain's GeGLU is tanh-GELU")
    if hf.get("use_bidirectional_attention"):
        c.refuse("use_bidirectional_attention", True, "jaxtrain's attention is causal")
    if hf.get("attention_bias"):
        c.refuse("attention_bias", True, "the gemma3 family has no biases")
    if not hf.get("tie_word_embeddings", True):
        c.refuse("tie_word_embeddings", False, "the gemma3 family's head is the embedding")
    return c.problems


def _tensors(self, spec, hf: dict | None = None) -> list[HFTensor]:
    d, h, g, k, f = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim, \
        spec.mlp_dim

    def attn(name, path, heads, out=False):
        return split_heads(f"{LAYER}self_attn.{name}.weight", ("blocks", "attn", path), d,
                           heads, k, transposed=True, out=out)

    def norm(name, path):
        return one(f"{LAYER}{name}.weight", (d,), ("blocks", path, "scale"))

    return [
        one("model.embed_tokens.weight", (spec.vocab_size, d), ("tok_embed",)),
        norm("input_layernorm", "attn_norm"),
        attn("q_proj", "w_q", h), attn("k_proj", "w_k", g), attn("v_proj", "w_v", g),
        attn("o_proj", "w_o", h, out=True),
        *([one(f"{LAYER}self_attn.{w}_norm.weight", (k,), ("blocks", "attn", f"{w}_norm"))
           for w in ("q", "k")] if self.qk_norm else []),
        norm("post_attention_layernorm", "post_attn_norm"),
        norm("pre_feedforward_layernorm", "mlp_norm"),
        linear(f"{LAYER}mlp.gate_proj.weight", (f, d), ("blocks", "mlp", "w_gate")),
        linear(f"{LAYER}mlp.up_proj.weight", (f, d), ("blocks", "mlp", "w_up")),
        linear(f"{LAYER}mlp.down_proj.weight", (d, f), ("blocks", "mlp", "w_down")),
        norm("post_feedforward_layernorm", "post_mlp_norm"),
        one("model.norm.weight", (d,), ("final_norm", "scale")),
    ]


def _export_config(self, spec) -> dict:
    theta = layer_types.windowed_theta(spec)
    if not self.rope_by_layer_type and theta not in (None, spec.rope_theta):
        raise ConfigError(f"model.rope_local_theta={spec.rope_local_theta} cannot be exported: "
                          f"transformers' {self.ARCHITECTURE} rotates every layer alike")
    if spec.attn_softcap and not self.softcap:
        raise ConfigError(f"model.attn_logit_softcap={spec.attn_softcap} cannot be exported: "
                          f"transformers' {self.ARCHITECTURE} never applies it")
    return {
        "architectures": [self.ARCHITECTURE], "model_type": self.model_type,
        "vocab_size": spec.vocab_size, "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_dim, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.attention_scale_dim or spec.head_dim,
        "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.norm_eps,
        **layer_types.export(spec, unused_window=4096),  # transformers' default
        "rope_parameters": {"full_attention": {"rope_type": "default",
                                               "rope_theta": spec.rope_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta":
                                                  layer_types.windowed_theta(spec) or 10000.0}}
        if self.rope_by_layer_type else {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attn_logit_softcapping": spec.attn_softcap or None,
        "final_logit_softcapping": spec.final_softcap or None,
        "attention_bias": False, "tie_word_embeddings": True,
        "initializer_range": spec.init_std, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None,
    }


@dataclasses.dataclass(frozen=True)
class Gemma:
    """An HF module's interface (see jaxtrain/hf/__init__.py) for a Gemma model_type."""

    model_type: str
    ARCHITECTURE: str
    FAMILY: str  # the jaxtrain model.family it imports into
    qk_norm: bool  # self_attn.{q,k}_norm (Gemma 3)
    softcap: bool  # transformers applies attn_logit_softcapping (Gemma 2)
    rope_by_layer_type: bool  # rope_parameters keyed by layer type (Gemma 3); else one
    SLIDING_WINDOW: bool = True  # config.json's sliding_window and layer_types (above)
    LAYER_TYPES: bool = True
    PEFT_LAYOUT: bool = True  # separate q/k/v/o and gate/up/down projections, as PEFT names

    check_config = _check_config
    tensors = _tensors
    export_config = _export_config


ENTRIES = {e.model_type: e for e in (
    Gemma("gemma3_text", "Gemma3ForCausalLM", "gemma3", qk_norm=True, softcap=False,
          rope_by_layer_type=True),
    Gemma("gemma2", "Gemma2ForCausalLM", "gemma2", qk_norm=False, softcap=True,
          rope_by_layer_type=False),
)}
