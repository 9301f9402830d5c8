"""LlamaForCausalLM <-> jaxtrain's llama family.

HF Llama keeps torch Linear weights [out, in] (jaxtrain: [in, out], with heads split out:
q_proj [H*K, D] -> w_q [D, H, K], k/v_proj [G*K, D] -> [D, G, K], o_proj [D, H*K] ->
w_o [H, K, D]); RoPE rotates the two halves of each head, as jaxtrain's `rope` does, so no
permutation of q/k rows is needed. The output head is separate unless tie_word_embeddings,
which is model.tie_embeddings both ways: the head is then the embedding table itself (one
array, no lm_head tensor). A model given untied (model.tie_embeddings=False) imports a tied
checkpoint with a copy of the table as its head, and exports it untied.
"""

from __future__ import annotations

from jaxtrain.hf.mapping import Checks, HFTensor, linear, one, split_heads

ARCHITECTURE = "LlamaForCausalLM"
FAMILY = "llama"  # the jaxtrain model.family it imports into
SLIDING_WINDOW = False  # transformers' Llama attends to every earlier token
MOE = "mixtral"  # the model_type a llama with model.moe exports as
PEFT_LAYOUT = True  # separate q/k/v/o and gate/up/down projections, as PEFT names them


def rope_theta(hf: dict) -> float:
    """transformers >= 5 nests it in rope_parameters; earlier versions keep it at the top."""
    return float((hf.get("rope_parameters") or {}).get("rope_theta",
                                                        hf.get("rope_theta", 10000.0)))


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a Llama config.json with cfg.model `m`, one message each."""
    c = check_shared(hf, m)
    c.equal("model.mlp_dim", m.mlp_dim, "intermediate_size", hf.get("intermediate_size", 11008))
    if m.moe.num_experts:
        c.problems.append(f"model.moe.num_experts={m.moe.num_experts} but a Llama checkpoint "
                          "has no experts (MixtralForCausalLM has)")
    # Mistral-style configs saved as llama can carry a window that transformers' Llama
    # ignores: a model trained with it is another function past the window, so a window
    # that matters within seq_len is refused rather than dropped or guessed.
    window = hf.get("sliding_window")
    if window and window < m.seq_len:
        c.refuse("sliding_window", window, "LlamaForCausalLM attends to every earlier token "
                 "(transformers ignores the key); remove the key if the model was trained "
                 "without a window")
    return c.problems


def check_shared(hf: dict, m) -> Checks:
    """The checks of every Llama-like config.json (Llama, Mixtral): all but the MLP's."""
    c = Checks()
    d, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    c.equal("model.d_model", m.d_model, "hidden_size", d)
    c.equal("model.num_layers", m.num_layers, "num_hidden_layers",
            hf.get("num_hidden_layers", 32))
    c.equal("model.num_heads", m.num_heads, "num_attention_heads", heads)
    kv = hf.get("num_key_value_heads") or heads
    c.equal("model.num_kv_heads", m.num_kv_heads or m.num_heads, "num_key_value_heads", kv)
    head_dim = hf.get("head_dim") or d // heads
    c.equal("model.head_dim", m.head_dim or m.d_model // m.num_heads,
            "head_dim" if hf.get("head_dim") else "hidden_size/num_attention_heads", head_dim)
    c.equal("model.vocab_size", m.vocab_size, "vocab_size", hf.get("vocab_size", 32000))
    c.equal("model.norm_eps", m.norm_eps, "rms_norm_eps", hf.get("rms_norm_eps", 1e-6))
    c.equal("model.rope_theta", m.rope_theta,
            "rope_parameters.rope_theta" if hf.get("rope_parameters") else "rope_theta",
            rope_theta(hf))
    if hf.get("hidden_act", "silu") != "silu":
        c.refuse("hidden_act", hf["hidden_act"], "jaxtrain's Llama MLP is SwiGLU (silu)")
    check_tie(c, hf, m)
    check_rope_scaling(c, hf, m)
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            c.refuse(key, hf[key], "jaxtrain's Llama has no biases")
    return c


def check_tie(c: Checks, hf: dict, m) -> None:
    """tie_word_embeddings (transformers' default for these families: false) is
    model.tie_embeddings; an untied model may take a tied checkpoint (its head a copy of the
    table), a tied one cannot take a separate lm_head."""
    tied = bool(hf.get("tie_word_embeddings", False))
    c.derive("model.tie_embeddings", tied)
    if m.tie_embeddings and not tied:
        c.problems.append("model.tie_embeddings=True but config.json tie_word_embeddings="
                          "false (the checkpoint has its own lm_head)")


def head_tensors(spec, hf: dict | None) -> list[HFTensor]:
    """The output head's tensor: none when the model ties it (the embedding table is the
    head); on import of a tied checkpoint into an untied model, a copy of the table."""
    if spec.tied_embeddings:
        return []
    copied = bool(hf and hf.get("tie_word_embeddings", False))
    return [linear("model.embed_tokens.weight" if copied else "lm_head.weight",
                   (spec.vocab_size, spec.d_model), ("lm_head",))]


# model.rope_scaling fields per type, with transformers' defaults where its dict may omit
# them (original_max_position_embeddings: config.json's max_position_embeddings).
ROPE_FIELDS = {
    "llama3": {"factor": None, "low_freq_factor": None, "high_freq_factor": None,
               "original_max_position_embeddings": None},
    "yarn": {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0,
             "beta_slow": 1.0, "attention_factor": 0.0, "truncate": True},
}
ROPE_TYPES = {"default": "none", "llama3": "llama3", "yarn": "yarn"}  # HF -> jaxtrain


def _rope_dict(hf: dict) -> tuple[str, dict]:
    """(the key it came from, the RoPE dict): rope_parameters (transformers >= 5), else
    rope_scaling (4.x); {} for plain RoPE."""
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key):
            return key, hf[key]
    return "rope_parameters", {}


def check_rope_scaling(c: Checks, hf: dict, m) -> None:
    """config.json's RoPE scaling against model.rope_scaling, field by field."""
    key, rope = _rope_dict(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        c.refuse(f"{key}.rope_type", kind, "jaxtrain implements RoPE scaling types "
                 f"{', '.join(ROPE_TYPES)}")
        return
    ours = m.rope_scaling
    c.equal("model.rope_scaling.type", ours.type, f"{key}.rope_type", ROPE_TYPES[kind])
    if ROPE_TYPES[kind] != ours.type or kind == "default":
        return
    for unsupported in ("mscale", "mscale_all_dim", "partial_rotary_factor"):
        if rope.get(unsupported) not in (None, 0, 1, 1.0):
            c.refuse(f"{key}.{unsupported}", rope[unsupported], "not implemented")
    defaults = {**ROPE_FIELDS[kind], "original_max_position_embeddings":
                hf.get("original_max_position_embeddings", hf.get("max_position_embeddings"))}
    for field, default in defaults.items():
        theirs = rope.get(field)
        theirs = default if theirs is None else theirs
        c.equal(f"model.rope_scaling.{field}", ours[field], f"{key}.{field}", theirs)


def export_rope(spec) -> dict:
    """rope_parameters for config.json: the type and its fields (none: plain RoPE)."""
    s = spec.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": spec.rope_theta}
    fields = {f: getattr(s, f) for f in ROPE_FIELDS[s.type]}
    if fields.get("attention_factor") == 0.0:
        fields["attention_factor"] = None  # transformers derives it, as jaxtrain's 0 does
    return {"rope_type": s.type, "rope_theta": spec.rope_theta, **fields}


LAYER = "model.layers.{i}."


def tensors(spec, hf: dict | None = None) -> list[HFTensor]:
    """The checkpoint's tensors, in file order (head_tensors: the head's, if any)."""
    d, f = spec.d_model, spec.mlp_dim
    mlp = [linear(f"{LAYER}mlp.gate_proj.weight", (f, d), ("blocks", "mlp", "w_gate")),
           linear(f"{LAYER}mlp.up_proj.weight", (f, d), ("blocks", "mlp", "w_up")),
           linear(f"{LAYER}mlp.down_proj.weight", (d, f), ("blocks", "mlp", "w_down"))]
    return around_mlp(spec, hf, "blocks", mlp)


def around_mlp(spec, hf: dict | None, blocks: str, mlp: list[HFTensor]) -> list[HFTensor]:
    """A Llama-like checkpoint's tensors with the given feed-forward ones; the layers'
    parameters live under `blocks` ('moe_blocks' for Mixtral)."""
    d, h, g, k, v = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim, \
        spec.vocab_size

    def attn(name, path, heads, out=False):
        return split_heads(f"{LAYER}self_attn.{name}.weight", (blocks, "attn", path), d,
                           heads, k, transposed=True, out=out)

    return [
        one("model.embed_tokens.weight", (v, d), ("tok_embed",)),
        one(f"{LAYER}input_layernorm.weight", (d,), (blocks, "attn_norm", "scale")),
        attn("q_proj", "w_q", h),
        attn("k_proj", "w_k", g),
        attn("v_proj", "w_v", g),
        attn("o_proj", "w_o", h, out=True),
        one(f"{LAYER}post_attention_layernorm.weight", (d,), (blocks, "mlp_norm", "scale")),
        *mlp,
        one("model.norm.weight", (d,), ("final_norm", "scale")),
        *head_tensors(spec, hf),
    ]


def export_config(spec) -> dict:
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "vocab_size": spec.vocab_size, "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_dim, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "hidden_act": "silu",
        "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.norm_eps,
        # Both spellings: transformers >= 5 reads rope_parameters, 4.x rope_theta and
        # rope_scaling.
        "rope_theta": spec.rope_theta, "rope_parameters": export_rope(spec),
        **({} if spec.rope_scaling is None else {"rope_scaling": export_rope(spec)}),
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": spec.tied_embeddings,
        "initializer_range": spec.init_std, "bos_token_id": None, "eos_token_id": None,
    }
