"""tiny_qwen3.py (tiny.py's job with 2 kv heads, a SwiGLU of 352 and q/k norms) with the
qwen3_5_text family's parts: three Gated DeltaNet layers (model.layer_types
linear_attention) to one gated full-attention layer with (1 + w) q/k norms and RoPE over a
quarter of each head (model.partial_rotary_factor): the docs' CPU example of a hybrid model
(docs/architecture.md), and the bench_hybrid.py model."""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("tiny_qwen3.py"))
    c.name = "tiny_qwen3_5"
    c.model.family = "qwen3_5_text"
    c.model.layer_types = "linear_attention,linear_attention,linear_attention,full"
    c.model.partial_rotary_factor = 0.25
    c.model.linear_attention.num_key_heads = 2
    c.model.linear_attention.num_value_heads = 4
    c.model.linear_attention.chunk_size = 64
    return c
