"""Llama-like Hugging Face model_types, one entry each: Llama's tensors and checks
(llama.py) plus what the family's parts add (models/families.py ATTENTION_PARTS).

- qwen2 (Qwen2ForCausalLM, Qwen2.5): q/k/v projection biases `self_attn.{q,k,v}_proj.bias`
  [heads·head_dim] -> b_q [H, K], b_k/b_v [G, K] (part qkv_bias); no output bias.
- qwen3 (Qwen3ForCausalLM, dense): `self_attn.{q,k}_norm.weight` [head_dim] -> q_norm,
  k_norm (part qk_norm); `attention_bias` must be false (no output bias in jaxtrain).
- mistral (MistralForCausalLM): Llama's tensors; config.json sliding_window (null: none) is
  model.sliding_window (0), both ways, on every layer: transformers' Mistral ignores a
  `layer_types`, so a jaxtrain pattern that mixes kinds is refused on export.
- qwen2, qwen3: `layer_types` (or, without it, `use_sliding_window` with the layers from
  `max_window_layers` on sliding) and `sliding_window` are model.layer_types and
  model.sliding_window (hf/layer_types.py), both ways; the sliding layers rotate as the
  full ones, so model.rope_local_theta must leave them so.

Refused: whatever llama.check_shared refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxtrain.hf import layer_types, llama
from jaxtrain.hf.mapping import HFTensor, one

LAYER = llama.LAYER


def _bias(name: str, path: str, heads: int, head_dim: int) -> HFTensor:
    return one(f"{LAYER}self_attn.{name}.bias", (heads * head_dim,), ("blocks", "attn", path),
               lambda x: x.reshape(heads, head_dim), lambda x: x.reshape(-1))


def _qkv_bias_tensors(spec) -> list[HFTensor]:
    h, g, k = spec.num_heads, spec.num_kv_heads, spec.head_dim
    return [_bias("q_proj", "b_q", h, k), _bias("k_proj", "b_k", g, k),
            _bias("v_proj", "b_v", g, k)]


def _qk_norm_tensors(spec) -> list[HFTensor]:
    k = spec.head_dim
    return [one(f"{LAYER}self_attn.{w}_norm.weight", (k,), ("blocks", "attn", f"{w}_norm"))
            for w in ("q", "k")]


def _qwen_types(hf: dict) -> list[str]:
    """transformers' Qwen2/3 layer_types: given, or from use_sliding_window and
    max_window_layers (sliding_window is dropped without use_sliding_window)."""
    n = hf.get("num_hidden_layers", 0)
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    first = hf.get("max_window_layers", 28) if hf.get("use_sliding_window") and \
        hf.get("sliding_window") is not None else n
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


def _qwen_window(c, hf: dict, m) -> None:
    hf = hf if hf.get("use_sliding_window") else {**hf, "sliding_window": None}
    layer_types.check(c, m, hf, _qwen_types(hf), "layer_types/use_sliding_window/"
                      "max_window_layers/sliding_window")
    theta = layer_types.windowed_theta(m)
    if theta is not None and theta != m.rope_theta:
        c.problems.append(f"model.rope_local_theta={m.rope_local_theta}: transformers' Qwen "
                          "rotates its sliding layers as the full ones (use 0)")


def _qwen_export(spec) -> dict:
    keys = layer_types.export(spec)
    sliding = [i for i, t in enumerate(keys["layer_types"]) if t == "sliding_attention"]
    return {**keys, "use_sliding_window": bool(sliding),
            "max_window_layers": sliding[0] if sliding else spec.num_layers}


def _mistral_window(c, hf: dict, m) -> None:
    layer_types.check(c, m, hf, ["sliding_attention"] * m.num_layers,
                      "sliding_window (on every layer: MistralForCausalLM ignores layer_types)")


@dataclasses.dataclass(frozen=True)
class LlamaLike:
    """An HF module's interface (see jaxtrain/hf/__init__.py) for a Llama-like model_type."""

    model_type: str
    ARCHITECTURE: str
    FAMILY: str  # the jaxtrain model.family it imports into
    SLIDING_WINDOW: bool  # config.json's sliding_window is model.sliding_window
    extra_tensors: Callable = lambda spec: []  # spec -> the parts' tensors, per layer
    check_extra: Callable = lambda c, hf, m: None  # (Checks, config.json, cfg.model)
    export_extra: Callable = lambda spec: {}  # spec -> config.json keys
    allow_attention_bias: bool = False  # config.json attention_bias may be true (Qwen2)
    PEFT_LAYOUT: bool = True  # separate q/k/v/o and gate/up/down projections, as PEFT names
    LAYER_TYPES: bool = False  # config.json's layer_types: a window per layer (hf/load.py)
    MOE: str | None = None  # the model_type the family with model.moe exports as

    def check_config(self, hf: dict, m) -> list[str]:
        shown = {k: v for k, v in hf.items() if k != "attention_bias"} \
            if self.allow_attention_bias else hf
        c = llama.check_shared(shown, m)
        c.equal("model.mlp_dim", m.mlp_dim, "intermediate_size", hf.get("intermediate_size"))
        if m.moe.num_experts:
            c.problems.append(f"model.moe.num_experts={m.moe.num_experts} but a "
                              f"{self.ARCHITECTURE} checkpoint has no experts")
        self.check_extra(c, hf, m)
        return c.problems

    def tensors(self, spec, hf: dict | None = None) -> list[HFTensor]:
        base = llama.tensors(spec, hf)
        return base[:6] + self.extra_tensors(spec) + base[6:]  # after the attention's

    def export_config(self, spec) -> dict:
        return {**llama.export_config(spec), "architectures": [self.ARCHITECTURE],
                "model_type": self.model_type, **self.export_extra(spec)}


ENTRIES = {e.model_type: e for e in (
    LlamaLike("qwen2", "Qwen2ForCausalLM", "qwen2", True, _qkv_bias_tensors,
              _qwen_window, _qwen_export, allow_attention_bias=True, LAYER_TYPES=True),
    LlamaLike("qwen3", "Qwen3ForCausalLM", "qwen3", True, _qk_norm_tensors,
              _qwen_window, _qwen_export, LAYER_TYPES=True, MOE="qwen3_moe"),
    LlamaLike("mistral", "MistralForCausalLM", "mistral", True, check_extra=_mistral_window,
              export_extra=lambda spec: {"sliding_window": spec.sliding_window or None}),
)}
