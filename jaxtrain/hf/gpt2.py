"""GPT2LMHeadModel <-> jaxtrain's gpt2 family.

HF GPT-2 keeps its matmul weights in Conv1D layout [in, out] (jaxtrain's too), fuses the
query, key and value projections into c_attn [D, 3D] (+ bias [3D]), uses tanh-GELU
("gelu_new"), learned positions wpe [n_positions, D] (jaxtrain: [seq_len, D]) and ties the
output head to wte. jaxtrain does not apply the key bias (softmax ignores it) but keeps it,
so that it round-trips.
"""

from __future__ import annotations

from jaxtrain.errors import ConfigError
from jaxtrain.hf.mapping import Checks, HFTensor, Part, one, split_heads

ARCHITECTURE = "GPT2LMHeadModel"
FAMILY = "gpt2"  # the jaxtrain model.family it imports into
SLIDING_WINDOW = False  # every query attends to every earlier token
# Names transformers gives tanh-approximated GELU; jax.nn.gelu's default is that one.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a GPT-2 config.json with cfg.model `m`, one message each."""
    c = Checks()
    d, heads = hf.get("n_embd", 768), hf.get("n_head", 12)
    c.equal("model.d_model", m.d_model, "n_embd", d)
    c.equal("model.num_layers", m.num_layers, "n_layer", hf.get("n_layer", 12))
    c.equal("model.num_heads", m.num_heads, "n_head", heads)
    if m.num_kv_heads not in (0, m.num_heads):
        c.equal("model.num_kv_heads", m.num_kv_heads, "n_head", heads)
    if m.head_dim and heads:
        c.equal("model.head_dim", m.head_dim, "n_embd/n_head", d // heads)
    inner = hf.get("n_inner")
    c.equal("model.mlp_dim", m.mlp_dim, "n_inner" if inner else "4*n_embd", inner or 4 * d)
    c.equal("model.vocab_size", m.vocab_size, "vocab_size", hf.get("vocab_size", 50257))
    positions = hf.get("n_positions", 1024)
    if m.seq_len > positions:
        c.problems.append(f"model.seq_len={m.seq_len} but config.json n_positions={positions}"
                          " (must be >= model.seq_len)")
    c.equal("model.norm_eps", m.norm_eps, "layer_norm_epsilon",
            hf.get("layer_norm_epsilon", 1e-5))
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        c.refuse("activation_function", act, "jaxtrain's GPT-2 uses tanh-GELU (gelu_new)")
    for key, supported in (("scale_attn_weights", True),
                           ("scale_attn_by_inverse_layer_idx", False),
                           ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if hf.get(key, supported) != supported:
            c.refuse(key, hf[key], f"jaxtrain's GPT-2 has {key}={supported}")
    return c.problems


def tensors(spec, hf: dict | None = None) -> list[HFTensor]:
    """The checkpoint's tensors, in file order; `hf` (the imported config.json) makes no
    difference for GPT-2: the head is always tied."""
    del hf
    d, h, k, f = spec.d_model, spec.num_heads, spec.head_dim, spec.mlp_dim
    hk = h * k

    def block(name, shape, *path, **kw):
        return one(f"transformer.h.{{i}}.{name}", shape, ("blocks", *path), **kw)

    def qkv(kind, jax_shape):  # c_attn: [..., q | k | v] along its last axis
        return tuple(Part(("blocks", "attn", f"{kind}_{x}"), hk,
                          lambda a: a.reshape(jax_shape),
                          lambda a: a.reshape(a.shape[:-2] + (hk,))) for x in "qkv")

    return [
        one("transformer.wte.weight", (spec.vocab_size, d), ("tok_embed",)),
        HFTensor("transformer.wpe.weight", (spec.seq_len, d),
                 (Part(("pos_embed",), spec.seq_len),), longer_ok=True),
        block("ln_1.weight", (d,), "attn_norm", "scale"),
        block("ln_1.bias", (d,), "attn_norm", "bias"),
        HFTensor("transformer.h.{i}.attn.c_attn.weight", (d, 3 * hk), qkv("w", (d, h, k)),
                 axis=1),
        HFTensor("transformer.h.{i}.attn.c_attn.bias", (3 * hk,), qkv("b", (h, k))),
        split_heads("transformer.h.{i}.attn.c_proj.weight", ("blocks", "attn", "w_o"),
                    d, h, k, transposed=False, out=True),
        block("attn.c_proj.bias", (d,), "attn", "b_o"),
        block("ln_2.weight", (d,), "mlp_norm", "scale"),
        block("ln_2.bias", (d,), "mlp_norm", "bias"),
        block("mlp.c_fc.weight", (d, f), "mlp", "w_up"),
        block("mlp.c_fc.bias", (f,), "mlp", "b_up"),
        block("mlp.c_proj.weight", (f, d), "mlp", "w_down"),
        block("mlp.c_proj.bias", (d,), "mlp", "b_down"),
        one("transformer.ln_f.weight", (d,), ("final_norm", "scale")),
        one("transformer.ln_f.bias", (d,), ("final_norm", "bias")),
    ]


def export_config(spec) -> dict:
    if spec.num_kv_heads != spec.num_heads or spec.head_dim * spec.num_heads != spec.d_model:
        raise ConfigError(f"model.num_kv_heads={spec.num_kv_heads}, model.head_dim="
                          f"{spec.head_dim} cannot be exported: HF GPT-2 has num_kv_heads = "
                          "num_heads and head_dim = d_model/num_heads")
    return {
        "architectures": [ARCHITECTURE], "model_type": "gpt2",
        "vocab_size": spec.vocab_size, "n_positions": spec.seq_len, "n_ctx": spec.seq_len,
        "n_embd": spec.d_model, "n_layer": spec.num_layers, "n_head": spec.num_heads,
        "n_inner": spec.mlp_dim, "activation_function": "gelu_new",
        "layer_norm_epsilon": spec.norm_eps, "initializer_range": spec.init_std,
        "tie_word_embeddings": True, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "bos_token_id": None, "eos_token_id": None,
    }
