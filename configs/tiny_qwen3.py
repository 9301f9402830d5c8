"""tiny.py's job (the stdlib byte corpus, 4 layers × 128) with the qwen3 family's parts
(RMSNorm, SwiGLU, RoPE, GQA, per-head q/k RMSNorm): the docs' CPU example of a family made
of parts (docs/architecture.md)."""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("tiny.py"))
    c.name = "tiny_qwen3"
    c.model.update(family="qwen3", num_kv_heads=2, norm_eps=1e-6)
    c.model.mlp_dim = 352  # SwiGLU's three matrices ≈ GELU's two of 512
    return c
