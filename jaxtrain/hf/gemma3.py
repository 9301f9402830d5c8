"""Gemma3ForCausalLM (model_type gemma3_text) <-> jaxtrain's gemma3 family.

Llama's projection layouts (llama.py); the norms are Gemma's (1 + w) RMSNorm, stored as w on
both sides: `input_layernorm` -> attn_norm, `post_attention_layernorm` -> post_attn_norm
(the sandwich norm on the attention's output, not Llama's pre-MLP norm),
`pre_feedforward_layernorm` -> mlp_norm, `post_feedforward_layernorm` -> post_mlp_norm,
`self_attn.{q,k}_norm` -> q_norm/k_norm. The head is the embedding table (tied; the
checkpoint has no lm_head). q·k is scaled by query_pre_attn_scalar**-0.5
(model.attention_scale_dim), the embeddings by sqrt(hidden_size).

Refused until jaxtrain has per-layer kinds: sliding layers in `layer_types` (Gemma 3's
default is 5 sliding : 1 full), so only all-full configs import; the soft-caps.
"""

from __future__ import annotations

from jaxtrain.hf import llama
from jaxtrain.hf.mapping import Checks, HFTensor, linear, one, split_heads

ARCHITECTURE = "Gemma3ForCausalLM"
FAMILY = "gemma3"  # the jaxtrain model.family it imports into
SLIDING_WINDOW = False  # sliding layers are refused (above): every layer attends fully
PEFT_LAYOUT = True  # separate q/k/v/o and gate/up/down projections, as PEFT names them
LAYER = llama.LAYER


def _full_theta(hf: dict) -> float:
    rope = (hf.get("rope_parameters") or {}).get("full_attention") or {}
    return float(rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a gemma3_text config.json with cfg.model `m`, one message each."""
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
    sliding = [i for i, t in enumerate(hf.get("layer_types") or []) if t != "full_attention"]
    if sliding or not hf.get("layer_types"):
        c.refuse("layer_types", f"sliding at layers {sliding or 'default 5:1'}",
                 "jaxtrain has no per-layer window pattern yet (only all full_attention)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key):
            c.refuse(key, hf[key], "soft-capping is not implemented")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        c.refuse("hidden_activation", hf["hidden_activation"], "jaxtrain's GeGLU is tanh-GELU")
    if hf.get("use_bidirectional_attention"):
        c.refuse("use_bidirectional_attention", True, "jaxtrain's attention is causal")
    if hf.get("attention_bias"):
        c.refuse("attention_bias", True, "the gemma3 family has no biases")
    if not hf.get("tie_word_embeddings", True):
        c.refuse("tie_word_embeddings", False, "the gemma3 family's head is the embedding")
    return c.problems


def tensors(spec, hf: dict | None = None) -> list[HFTensor]:
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
        one(f"{LAYER}self_attn.q_norm.weight", (k,), ("blocks", "attn", "q_norm")),
        one(f"{LAYER}self_attn.k_norm.weight", (k,), ("blocks", "attn", "k_norm")),
        norm("post_attention_layernorm", "post_attn_norm"),
        norm("pre_feedforward_layernorm", "mlp_norm"),
        linear(f"{LAYER}mlp.gate_proj.weight", (f, d), ("blocks", "mlp", "w_gate")),
        linear(f"{LAYER}mlp.up_proj.weight", (f, d), ("blocks", "mlp", "w_up")),
        linear(f"{LAYER}mlp.down_proj.weight", (d, f), ("blocks", "mlp", "w_down")),
        norm("post_feedforward_layernorm", "post_mlp_norm"),
        one("model.norm.weight", (d,), ("final_norm", "scale")),
    ]


def export_config(spec) -> dict:
    return {
        "architectures": [ARCHITECTURE], "model_type": "gemma3_text",
        "vocab_size": spec.vocab_size, "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_dim, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.attention_scale_dim or spec.head_dim,
        "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.norm_eps,
        "layer_types": ["full_attention"] * spec.num_layers,
        "rope_parameters": {"full_attention": {"rope_type": "default",
                                               "rope_theta": spec.rope_theta},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}},
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "attention_bias": False, "tie_word_embeddings": True,
        "initializer_range": spec.init_std, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None,
    }
