"""GptOssForCausalLM (model_type gpt_oss) <-> jaxtrain's gpt_oss family (every layer MoE).

Attention is Llama's tensors plus transformers' `attention_bias` (true): q/k/v/o_proj biases
`self_attn.{q,k,v}_proj.bias` [heads·head_dim] -> b_q [H, K], b_k/b_v [G, K] and
`o_proj.bias` [D] -> b_o (the family's bias; the key bias is rotated with the key, so it
counts), and `self_attn.sinks` [H] (attention part sinks). `layer_types` and `sliding_window`
are model.layer_types and model.sliding_window both ways (hf/layer_types.py; transformers'
default alternates sliding, full); every layer rotates alike (model.rope_local_theta 0), by
rope_parameters (gpt-oss's YaRN, truncate false, maps onto model.rope_scaling).

Each layer's feed-forward is experts only (no dense MLP): `mlp.router.weight` [E, D] and
`mlp.router.bias` [E] -> w_router [D, E], b_router [E]; `mlp.experts.gate_up_proj`
[E, D, 2F] ([in, out], gate at even and up at odd columns) -> w_gate, w_up [E, D, F];
`gate_up_proj_bias` [E, 2F] (interleaved alike) -> b_gate, b_up; `down_proj` [E, F, D] and
`down_proj_bias` [E, D] -> w_down, b_down; F is intermediate_size (model.moe.expert_mlp_dim).
The experts are the clamped SwiGLU (models/families.py EXPERT_KINDS swiglu_clamped: its alpha
and limit must be config.json's swiglu_alpha and swiglu_limit). transformers' router takes
the top k of the biased logits and softmaxes those k: jaxtrain's softmax over all E
renormalised over the k (model.moe.norm_topk_prob true) is the same function.
router_aux_loss_coef is model.moe.aux_loss_weight / top_k (as Mixtral's).

Refused: an MXFP4 (or any) quantization_config (the hub's gpt-oss checkpoints: dequantize
them with transformers first), attention_bias false, other swiglu_alpha/swiglu_limit, and
whatever llama.check_shared refuses (hidden_act other than silu, other RoPE types).
"""

from __future__ import annotations

from jaxtrain.hf import layer_types, llama
from jaxtrain.hf.mapping import HFTensor, Part, linear, one
from jaxtrain.models.families import FAMILIES

ARCHITECTURE = "GptOssForCausalLM"
FAMILY = "gpt_oss"  # the jaxtrain model.family it imports into
MOE = "gpt_oss"  # with model.moe (always: the family has no dense layers) it exports as itself
SLIDING_WINDOW = True
LAYER_TYPES = True
MOE_LAYOUTS = True  # its own MoE checks (shared experts refused by ARCHITECTURE)
PEFT_LAYOUT = True  # separate q/k/v/o projections, as PEFT names them (experts refused)
LAYER = llama.LAYER

# transformers' GptOssConfig defaults for the keys read here (a config.json may omit them).
DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088,
    "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
    "rms_norm_eps": 1e-5, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0, "attention_bias": True, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096},
}


def _kind():
    return FAMILIES[FAMILY].expert_kind


def _types(hf: dict) -> list[str]:
    """transformers' layer_types: given, or sliding on even layers, full on odd ones."""
    n = hf["num_hidden_layers"]
    return list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else
                                          "full_attention" for i in range(n)])


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a gpt-oss config.json with cfg.model `m`, one message each."""
    hf = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "sliding_window"}}
    c = llama.check_shared({k: v for k, v in hf.items() if k != "attention_bias"}, m)
    if not hf["attention_bias"]:
        c.refuse("attention_bias", hf["attention_bias"], "jaxtrain's gpt_oss has q/k/v/o "
                 "biases (transformers' default true)")
    if hf.get("quantization_config"):
        c.refuse("quantization_config", hf["quantization_config"].get("quant_method", "?"),
                 "quantized experts (MXFP4) are not read: dequantize with transformers "
                 "(Mxfp4Config(dequantize=True)) and save_pretrained first")
    kind = _kind()
    c.equal("swiglu_alpha (the gpt_oss expert kind's)", kind.alpha, "swiglu_alpha",
            hf["swiglu_alpha"])
    c.equal("swiglu_limit (the gpt_oss expert kind's)", kind.limit, "swiglu_limit",
            hf["swiglu_limit"])
    moe = m.moe
    c.equal("model.moe.num_experts", moe.num_experts, "num_local_experts",
            hf["num_local_experts"])
    c.equal("model.moe.top_k", moe.top_k, "num_experts_per_tok", hf["num_experts_per_tok"])
    c.equal("model.moe.expert_mlp_dim (0: model.mlp_dim)", moe.expert_mlp_dim or m.mlp_dim,
            "intermediate_size", hf["intermediate_size"])
    if moe.shared_experts:
        c.problems.append(f"model.moe.shared_experts={moe.shared_experts} but gpt-oss has no "
                          "shared experts (use 0)")
    if not moe.norm_topk_prob:
        c.problems.append("model.moe.norm_topk_prob=False but gpt-oss softmaxes the k picked "
                          "logits (use True)")
    layer_types.check(c, m, hf, _types(hf), "layer_types/sliding_window")
    theta = layer_types.windowed_theta(m)
    if theta is not None and theta != m.rope_theta:
        c.problems.append(f"model.rope_local_theta={m.rope_local_theta}: transformers' gpt-oss "
                          "rotates its sliding layers as the full ones (use 0)")
    return c.problems


def _bias(name: str, path: str, shape: tuple[int, ...]) -> HFTensor:
    size = 1
    for s in shape:
        size *= s
    return one(f"{LAYER}self_attn.{name}.bias", (size,), ("moe_blocks", "attn", path),
               lambda x: x.reshape(shape), lambda x: x.reshape(-1))


def _attention_extra(spec) -> list[HFTensor]:
    h, g, k, d = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.d_model
    return [_bias("q_proj", "b_q", (h, k)), _bias("k_proj", "b_k", (g, k)),
            _bias("v_proj", "b_v", (g, k)), _bias("o_proj", "b_o", (d,)),
            one(f"{LAYER}self_attn.sinks", (h,), ("moe_blocks", "attn", "sinks"))]


def _experts(spec) -> list[HFTensor]:
    d, e, f = spec.d_model, spec.moe.num_experts, spec.moe.expert_mlp_dim
    mlp, experts = ("moe_blocks", "mlp"), f"{LAYER}mlp.experts."

    def pair(name, shape, gate, up):  # gate at even, up at odd indices of the last axis
        return HFTensor(name, shape, (Part((*mlp, gate), f), Part((*mlp, up), f)),
                        axis=len(shape) - 1, interleaved=True)

    return [linear(f"{LAYER}mlp.router.weight", (e, d), (*mlp, "w_router")),
            one(f"{LAYER}mlp.router.bias", (e,), (*mlp, "b_router")),
            pair(f"{experts}gate_up_proj", (e, d, 2 * f), "w_gate", "w_up"),
            pair(f"{experts}gate_up_proj_bias", (e, 2 * f), "b_gate", "b_up"),
            one(f"{experts}down_proj", (e, f, d), (*mlp, "w_down")),
            one(f"{experts}down_proj_bias", (e, d), (*mlp, "b_down"))]


def tensors(spec, hf: dict | None = None) -> list[HFTensor]:
    base = llama.around_mlp(spec, hf, "moe_blocks", _experts(spec))
    return base[:6] + _attention_extra(spec) + base[6:]  # after the attention's weights


def export_config(spec) -> dict:
    moe, kind = spec.moe, _kind()
    config = {k: v for k, v in llama.export_config(spec).items() if k != "mlp_bias"}
    return {
        **config, "architectures": [ARCHITECTURE], "model_type": "gpt_oss",
        "intermediate_size": moe.expert_mlp_dim, "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k, "attention_bias": True,
        "swiglu_alpha": kind.alpha, "swiglu_limit": kind.limit,
        "output_router_logits": False,
        # transformers' load-balancing loss is top_k × jaxtrain's (models/moe.py).
        "router_aux_loss_coef": moe.aux_loss_weight / moe.top_k,
        **layer_types.export(spec),
    }
