"""Qwen3_5ForCausalLM (model_type qwen3_5_text) <-> jaxtrain's qwen3_5_text family: Gated
DeltaNet layers (`linear_attn.*`, model.layer_types linear_attention, stacked under
`linear_blocks`) between gated full-attention layers (`self_attn.*`, under `blocks`).

- self_attn.q_proj [heads·2·head_dim, D]: per head, the query's head_dim rows then the
  output gate's (HFTensor groups) -> w_q, w_gate [D, H, K] (parts qk_norm, output_gate);
  q_norm/k_norm and every RMSNorm but the DeltaNet's are (1 + w), as model.norm_offset.
- linear_attn.in_proj_qkv [2·Hk·Kd + Hv·Vd, D] -> w_q, w_k [D, Hk, Kd], w_v [D, Hv, Vd];
  conv1d.weight [channels, 1, W] likewise -> conv_q, conv_k, conv_v [W, heads, dim];
  in_proj_z -> w_z, in_proj_a/b -> w_a/w_b [D, Hv]; dt_bias, A_log [Hv]; norm.weight [Vd]
  (the gated norm: w, not 1 + w); out_proj -> w_o [Hv, Vd, D].
- config.json: layer_types (linear_attention / full_attention) is model.layer_types;
  linear_* are model.linear_attention's; rope_parameters.partial_rotary_factor is
  model.partial_rotary_factor; tie_word_embeddings model.tie_embeddings.
- A full Qwen3_5ForConditionalGeneration (model_type qwen3_5: text_config nested, the text
  model under model.language_model.) imports its text model; the vision tower's tensors
  are left, in one line.
Refused: attention_bias, a hidden_act other than silu, RoPE scaling (mrope with text-only
positions is plain RoPE: its sections only matter for images).
"""

from __future__ import annotations

import dataclasses

from jaxtrain.hf import llama
from jaxtrain.hf.mapping import HFTensor, Part, linear, one, split_heads
from jaxtrain.models.families import LAYER_KINDS, layer_pattern

ARCHITECTURE = "Qwen3_5ForCausalLM"
FAMILY = "qwen3_5_text"
SLIDING_WINDOW = False
LAYER_TYPES = True  # layer_types is model.layer_types (hf/load.py)
PEFT_LAYOUT = False  # LoRA is not mapped onto the DeltaNet's fused in_proj_qkv
LINEAR = {"num_key_heads": "linear_num_key_heads", "num_value_heads": "linear_num_value_heads",
          "key_head_dim": "linear_key_head_dim", "value_head_dim": "linear_value_head_dim",
          "conv_kernel": "linear_conv_kernel_dim"}
HF_KIND = {"linear_attention": "linear_attention", "full_attention": "full"}


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a Qwen3.5 text config.json with cfg.model `m`, one message each."""
    hf = hf.get("text_config") or hf
    c = llama.check_shared(hf, m)
    c.equal("model.mlp_dim", m.mlp_dim, "intermediate_size", hf.get("intermediate_size"))
    rope = hf.get("rope_parameters") or {}
    c.equal("model.partial_rotary_factor", m.partial_rotary_factor,
            "rope_parameters.partial_rotary_factor", float(rope.get("partial_rotary_factor",
                                                                    0.25)))
    types = [HF_KIND.get(t, t) for t in hf.get("layer_types") or []]
    c.equal("model.layer_types", ",".join(layer_pattern(m.layer_types, m.num_layers)),
            "layer_types", ",".join(types))
    s = m.linear_attention
    defaults = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                "linear_num_value_heads": 32}
    for ours, theirs in LINEAR.items():
        c.equal(f"model.linear_attention.{ours}", s[ours], theirs,
                hf.get(theirs, defaults[theirs]))
    if m.moe.num_experts:
        c.problems.append(f"model.moe.num_experts={m.moe.num_experts} but a {ARCHITECTURE} "
                          "checkpoint has no experts")
    return c.problems


def _layers(spec, linear: bool) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(spec.layer_types) if LAYER_KINDS[k].linear == linear)


def _attention(spec) -> list[HFTensor]:
    d, h, g, k = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim
    layer = llama.LAYER + "self_attn."

    def q_part(path):
        return Part(("blocks", "attn", path), h * k, lambda x: x.T.reshape(d, h, k),
                    lambda x: x.reshape(d, h * k).T)

    def attn(name, path, heads, out=False):
        return split_heads(f"{layer}{name}.weight", ("blocks", "attn", path), d, heads, k,
                           transposed=True, out=out)

    return [HFTensor(f"{layer}q_proj.weight", (2 * h * k, d), (q_part("w_q"),
                                                               q_part("w_gate")), groups=h),
            attn("k_proj", "w_k", g), attn("v_proj", "w_v", g), attn("o_proj", "w_o", h, True),
            one(f"{layer}q_norm.weight", (k,), ("blocks", "attn", "q_norm")),
            one(f"{layer}k_norm.weight", (k,), ("blocks", "attn", "k_norm"))]


def _linear(spec) -> list[HFTensor]:
    ls, d = spec.linear, spec.d_model
    layer, stack = llama.LAYER + "linear_attn.", "linear_blocks"
    shapes = {"q": (ls.key_heads, ls.key_dim), "k": (ls.key_heads, ls.key_dim),
              "v": (ls.value_heads, ls.value_dim)}

    def proj(n, heads, dim):
        return Part((stack, "attn", f"w_{n}"), heads * dim, lambda x: x.T.reshape(d, heads, dim),
                    lambda x: x.reshape(d, heads * dim).T)

    def conv(n, heads, dim):
        w = ls.conv
        return Part((stack, "attn", f"conv_{n}"), heads * dim,
                    lambda x: x[:, 0, :].T.reshape(w, heads, dim),
                    lambda x: x.reshape(w, heads * dim).T[:, None, :])

    channels = sum(a * b for a, b in shapes.values())
    hv, vd = ls.value_heads, ls.value_dim
    return [
        HFTensor(f"{layer}in_proj_qkv.weight", (channels, d),
                 tuple(proj(n, *shapes[n]) for n in "qkv")),
        HFTensor(f"{layer}in_proj_z.weight", (hv * vd, d), (proj("z", hv, vd),)),
        linear(f"{layer}in_proj_b.weight", (hv, d), (stack, "attn", "w_b")),
        linear(f"{layer}in_proj_a.weight", (hv, d), (stack, "attn", "w_a")),
        HFTensor(f"{layer}conv1d.weight", (channels, 1, ls.conv),
                 tuple(conv(n, *shapes[n]) for n in "qkv")),
        one(f"{layer}dt_bias", (hv,), (stack, "attn", "dt_bias")),
        one(f"{layer}A_log", (hv,), (stack, "attn", "A_log")),
        one(f"{layer}norm.weight", (vd,), (stack, "attn", "norm")),
        split_heads(f"{layer}out_proj.weight", (stack, "attn", "w_o"), d, hv, vd,
                    transposed=True, out=True)]


def _block_common(spec, stack: str) -> list[HFTensor]:
    d, f = spec.d_model, spec.mlp_dim
    return [one(f"{llama.LAYER}input_layernorm.weight", (d,), (stack, "attn_norm", "scale")),
            one(f"{llama.LAYER}post_attention_layernorm.weight", (d,),
                (stack, "mlp_norm", "scale")),
            linear(f"{llama.LAYER}mlp.gate_proj.weight", (f, d), (stack, "mlp", "w_gate")),
            linear(f"{llama.LAYER}mlp.up_proj.weight", (f, d), (stack, "mlp", "w_up")),
            linear(f"{llama.LAYER}mlp.down_proj.weight", (d, f), (stack, "mlp", "w_down"))]


def tensors(spec, hf: dict | None = None) -> list[HFTensor]:
    """The checkpoint's tensors: each layer's of its stack (HFTensor.layers), in the text
    model's names, or the full model's (model.language_model.) when hf is a
    Qwen3_5ForConditionalGeneration's config.json."""
    full, lin = _layers(spec, False), _layers(spec, True)
    layered = [dataclasses.replace(t, layers=full)
               for t in _attention(spec) + _block_common(spec, "blocks")]
    layered += [dataclasses.replace(t, layers=lin)
                for t in _linear(spec) + _block_common(spec, "linear_blocks")]
    d, v = spec.d_model, spec.vocab_size
    out = [one("model.embed_tokens.weight", (v, d), ("tok_embed",)), *layered,
           one("model.norm.weight", (d,), ("final_norm", "scale")),
           *llama.head_tensors(spec, hf.get("text_config", hf) if hf else None)]
    if hf and hf.get("text_config"):  # the full model: its text model's names
        out = [dataclasses.replace(t, name=t.name.replace("model.", "model.language_model.", 1))
               if t.name.startswith("model.") else t for t in out]
    return out


def export_config(spec) -> dict:
    base = llama.export_config(spec)
    types = ["linear_attention" if LAYER_KINDS[k].linear else "full_attention"
             for k in spec.layer_types]
    ls = spec.linear
    rope = {**llama.export_rope(spec), "partial_rotary_factor": spec.rope_fraction}
    shape = {theirs: getattr(ls, ours) for ours, theirs in (
        ("key_heads", "linear_num_key_heads"), ("value_heads", "linear_num_value_heads"),
        ("key_dim", "linear_key_head_dim"), ("value_dim", "linear_value_head_dim"),
        ("conv", "linear_conv_kernel_dim"))}
    return {**base, "architectures": [ARCHITECTURE], "model_type": "qwen3_5_text",
            "layer_types": types, "rope_parameters": rope, **shape}


@dataclasses.dataclass(frozen=True)
class _WithVision:
    """model_type qwen3_5 (Qwen3_5ForConditionalGeneration): imports its text model, the
    vision tower's tensors (model.visual.*) left in one line; exports as the text model."""

    ARCHITECTURE: str = "Qwen3_5ForConditionalGeneration"
    FAMILY: str = FAMILY
    SLIDING_WINDOW: bool = False
    LAYER_TYPES: bool = True
    PEFT_LAYOUT: bool = False
    LEFT_PREFIX: str = "model.visual."
    check_config = staticmethod(check_config)
    tensors = staticmethod(tensors)
    export_config = staticmethod(export_config)


WITH_VISION = _WithVision()
