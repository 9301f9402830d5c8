"""Qwen3MoeForCausalLM (model_type qwen3_moe) <-> jaxtrain's qwen3 family with model.moe.

Attention and norms are Qwen3 dense's (llama_like.py: Llama's tensors plus the per-head
`self_attn.{q,k}_norm`). Layer i is MoE when (i + 1) % decoder_sparse_step == 0, which is
model.moe.every_n_layers's layout (layers n-1, 2n-1, ...): its parameters live under
`moe_blocks`, the other layers' under `blocks` (each tensor names the HF layers it stacks,
HFTensor.layers). An MoE layer: `mlp.gate.weight` [E, D] (jaxtrain's router w_router
[D, E]) and per expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (as transformers 5
writes them), of moe_intermediate_size (model.moe.expert_mlp_dim); a dense layer: Llama's
`mlp.{gate,up,down}_proj` of intermediate_size (model.mlp_dim). The routing is the same
function: softmax over the E router logits in float32, top k, renormalised over the k only
with norm_topk_prob (model.moe.norm_topk_prob; transformers' default false).
router_aux_loss_coef is model.moe.aux_loss_weight / top_k (transformers' load-balancing loss
is top_k × jaxtrain's, as Mixtral's). The window keys map as qwen3's (layer_types.py).

Refused: a non-empty mlp_only_layers (dense layers off the every-n layout: jaxtrain's
groups repeat), shared experts, and whatever qwen3's checks refuse.
"""

from __future__ import annotations

import dataclasses

from jaxtrain.hf import llama, llama_like
from jaxtrain.hf.mapping import HFTensor, linear, one

ARCHITECTURE = "Qwen3MoeForCausalLM"
FAMILY = "qwen3"  # the jaxtrain model.family it imports into
SLIDING_WINDOW = True  # layer_types / sliding_window map as qwen3's
LAYER_TYPES = True
MOE_LAYOUTS = True  # any model.moe.every_n_layers (decoder_sparse_step)
PEFT_LAYOUT = True  # separate q/k/v/o and gate/up/down projections, as PEFT names them
_QWEN3 = llama_like.ENTRIES["qwen3"]
LAYER = llama.LAYER


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a Qwen3-MoE config.json with cfg.model `m`, one message each."""
    c = llama.check_shared({k: v for k, v in hf.items() if k != "attention_bias"}, m)
    if hf.get("attention_bias"):
        c.refuse("attention_bias", True, "an output bias jaxtrain does not have")
    moe = m.moe
    c.equal("model.moe.num_experts", moe.num_experts, "num_experts",
            hf.get("num_experts", hf.get("num_local_experts", 128)))
    c.equal("model.moe.top_k", moe.top_k, "num_experts_per_tok", hf.get("num_experts_per_tok", 8))
    c.equal("model.moe.expert_mlp_dim (0: model.mlp_dim)", moe.expert_mlp_dim or m.mlp_dim,
            "moe_intermediate_size", hf.get("moe_intermediate_size", 768))
    step = hf.get("decoder_sparse_step", 1)
    c.equal("model.moe.every_n_layers", moe.every_n_layers, "decoder_sparse_step", step)
    if step > 1:  # dense layers exist: their width is intermediate_size
        c.equal("model.mlp_dim", m.mlp_dim, "intermediate_size", hf.get("intermediate_size"))
    c.equal("model.moe.norm_topk_prob", moe.norm_topk_prob, "norm_topk_prob",
            hf.get("norm_topk_prob", False))
    if moe.shared_experts:
        c.problems.append(f"model.moe.shared_experts={moe.shared_experts} but Qwen3-MoE has "
                          "no shared experts (use 0)")
    if hf.get("mlp_only_layers"):
        c.refuse("mlp_only_layers", hf["mlp_only_layers"], "dense layers off the "
                 "decoder_sparse_step layout (jaxtrain's MoE layers repeat every n)")
    _QWEN3.check_extra(c, hf, m)
    return c.problems


def _attention(spec, blocks: str) -> list[HFTensor]:
    """One layer's attention and norms (Qwen3's) under `blocks`."""
    k = spec.head_dim
    tensors = llama.around_mlp(spec, None, blocks, [])
    norms = [one(f"{LAYER}self_attn.{w}_norm.weight", (k,), (blocks, "attn", f"{w}_norm"))
             for w in ("q", "k")]
    return [t for t in tensors if t.per_layer] + norms


def _experts(spec) -> list[HFTensor]:
    d, e, f = spec.d_model, spec.moe.num_experts, spec.moe.expert_mlp_dim

    def expert(name, out_in, param):
        return dataclasses.replace(
            linear(f"{LAYER}mlp.experts.{{e}}.{name}.weight", out_in,
                   ("moe_blocks", "mlp", param)), experts=e)

    return [linear(f"{LAYER}mlp.gate.weight", (e, d), ("moe_blocks", "mlp", "w_router")),
            expert("gate_proj", (f, d), "w_gate"), expert("up_proj", (f, d), "w_up"),
            expert("down_proj", (d, f), "w_down")]


def _dense_mlp(spec) -> list[HFTensor]:
    d, f = spec.d_model, spec.mlp_dim
    return [linear(f"{LAYER}mlp.{name}.weight", shape, ("blocks", "mlp", param))
            for name, shape, param in (("gate_proj", (f, d), "w_gate"),
                                       ("up_proj", (f, d), "w_up"),
                                       ("down_proj", (d, f), "w_down"))]


def tensors(spec, hf: dict | None = None) -> list[HFTensor]:
    n = spec.moe.every_n_layers
    moe_layers = tuple(i for i in range(spec.num_layers) if (i + 1) % n == 0)
    dense_layers = tuple(i for i in range(spec.num_layers) if (i + 1) % n)
    whole = llama.around_mlp(spec, hf, "moe_blocks", [])
    layered = [dataclasses.replace(t, layers=moe_layers)
               for t in _attention(spec, "moe_blocks") + _experts(spec)]
    if dense_layers:
        layered += [dataclasses.replace(t, layers=dense_layers)
                    for t in _attention(spec, "blocks") + _dense_mlp(spec)]
    return [whole[0], *layered, *(t for t in whole[1:] if not t.per_layer)]


def export_config(spec) -> dict:
    moe = spec.moe
    config = _QWEN3.export_config(spec)
    return {
        **config, "architectures": [ARCHITECTURE], "model_type": "qwen3_moe",
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_mlp_dim, "decoder_sparse_step": moe.every_n_layers,
        "mlp_only_layers": [], "norm_topk_prob": moe.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": moe.aux_loss_weight / moe.top_k,
    }
