"""A small Mixtral-style MoE on the built-in stdlib byte corpus; minutes on a laptop CPU.

Llama family, 4 layers, d_model 128, every layer MoE: 8 SwiGLU experts of width 256, top-2,
so each token uses a SwiGLU of width 512 (≈ the active parameters of a dense llama with
mlp_dim 512: `--config.model.moe.num_experts=0` is that model) out of 8 × 256 in total.
docs/benchmarks.md compares the two (scripts/bench_moe_tiny.py).
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("tiny.py"))
    c.name = "tiny_moe"
    c.model.family = "llama"
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 512  # the dense model of the same active parameters
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.expert_mlp_dim = 256
    return c
