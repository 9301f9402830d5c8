"""Llama-like Hugging Face model_types, one entry each: Llama's tensors and checks
(llama.py) plus what the family's parts add (models/families.py ATTENTION_PARTS).

- qwen2 (Qwen2ForCausalLM, Qwen2.5): q/k/v projection biases `self_attn.{q,k,v}_proj.bias`
  [heads·head_dim] -> b_q [H, K], b_k/b_v [G, K] (part qkv_bias); no output bias.
- qwen3 (Qwen3ForCausalLM, dense): `self_attn.{q,k}_norm.weight` [head_dim] -> q_norm,
  k_norm (part qk_norm); `attention_bias` must be false (no output bias in jaxtrain).
- mistral (MistralForCausalLM): Llama's tensors; config.json sliding_window (null: none) is
  model.sliding_window (0), both ways.

Refused: Qwen's `use_sliding_window` (a per-layer window from max_window_layers: jaxtrain
has one window for every layer), and whatever llama.check_shared refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxtrain.hf import llama
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


def _no_qwen_window(c, hf: dict, m) -> None:
    if hf.get("use_sliding_window"):
        c.refuse("use_sliding_window", True, "Qwen's window applies to the layers from "
                 "max_window_layers on; jaxtrain has one window for every layer")


def _mistral_window(c, hf: dict, m) -> None:
    window = hf.get("sliding_window")
    if (m.sliding_window or None) != window:
        c.problems.append(f"model.sliding_window={m.sliding_window} but config.json "
                          f"sliding_window={window} (0 is null: full causal attention)")


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
    LlamaLike("qwen2", "Qwen2ForCausalLM", "qwen2", False, _qkv_bias_tensors,
              _no_qwen_window, lambda spec: {"use_sliding_window": False},
              allow_attention_bias=True),
    LlamaLike("qwen3", "Qwen3ForCausalLM", "qwen3", False, _qk_norm_tensors,
              _no_qwen_window, lambda spec: {"use_sliding_window": False}),
    LlamaLike("mistral", "MistralForCausalLM", "mistral", True, check_extra=_mistral_window,
              export_extra=lambda spec: {"sliding_window": spec.sliding_window or None}),
)}
