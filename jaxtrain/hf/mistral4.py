"""Mistral4ForCausalLM (model_type mistral4) <-> jaxtrain's mistral4 family: DeepSeek-V3's
parts (deepseek_v3.py: the same tensor names, multi-head latent attention, shared and
routed experts, an optional dense prefix; the routed experts fused,
`mlp.experts.gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F], as transformers saves
them) with Mistral 4's router, model.moe.router 'softmax_group' (softmax probabilities,
group-limited, scaled; no correction bias).

Mistral 4 multiplies each query by 1 + β·log(1 + ⌊position / original_max_position_embeddings⌋)
(rope_parameters.llama_4_scaling_beta): exactly 1 below original_max_position_embeddings,
so a model.seq_len within it maps as is; a longer one is refused. RoPE as DeepSeek-V3's
(deepseek_v3.check_rope: plain or YaRN; transformers' Mistral 4 rotates the rope dims
right only under YaRN, which honours partial_rotary_factor).
"""

from __future__ import annotations

from jaxtrain.hf import deepseek_v3, llama

ARCHITECTURE = "Mistral4ForCausalLM"
FAMILY = "mistral4"
MOE = "mistral4"
SLIDING_WINDOW = False
MOE_LAYOUTS = True
SHARED_EXPERTS = True
ROUTER = "softmax_group"
# Mistral4Config's defaults
DEFAULTS = {**deepseek_v3.DEFAULTS, "hidden_size": 4096, "num_hidden_layers": 36,
            "num_attention_heads": 32, "vocab_size": 131072, "intermediate_size": 12288,
            "kv_lora_rank": 256, "q_lora_rank": 1024, "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 128,
            "num_experts_per_tok": 4, "moe_intermediate_size": 2048, "n_shared_experts": 1,
            "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0}


def tensors(spec, hf: dict | None = None):
    """DeepSeek-V3's tensors, the experts fused as transformers saves Mistral 4's."""
    return deepseek_v3.tensors(spec, hf, fused=True)


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a Mistral 4 config.json with cfg.model `m`, one message each."""
    c = deepseek_v3.check_shared(hf, m, DEFAULTS, ROUTER)
    key, rope = llama._rope_dict(hf)
    beta, original = rope.get("llama_4_scaling_beta"), rope.get(
        "original_max_position_embeddings")
    if beta and (original is None or m.seq_len > original):
        c.refuse(f"{key}.llama_4_scaling_beta", beta, f"the query scale past "
                 f"original_max_position_embeddings={original} is not implemented: "
                 "model.seq_len must stay within it")
    return c.problems


def export_config(spec) -> dict:
    rope = deepseek_v3.export_rope(spec)
    return {**deepseek_v3.export_shared(spec, ARCHITECTURE, ROUTER), "model_type": "mistral4",
            "rope_parameters": {**rope, "llama_4_scaling_beta": 0.0,
                                "original_max_position_embeddings": rope.get(
                                    "original_max_position_embeddings", spec.seq_len)}}
