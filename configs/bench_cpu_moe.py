"""The CPU benchmark's MoE counterpart (docs/benchmarks.md): configs/bench_cpu.py's shape
(512 wide, 8 layers, seq 512, batch 8, float32) as a Llama with every layer MoE: 8 SwiGLU
experts of width 1408 (each ≈ bench_cpu's GELU MLP of width 2048 in parameters), top-2."""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("bench_cpu.py"))
    c.name = "bench_cpu_moe"
    c.model.family = "llama"
    c.model.mlp_dim = 1408
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    return c
