"""The CPU benchmark's MoE counterpart (docs/benchmarks.md): configs/bench_cpu.py's shape
(512 wide, 8 layers, seq 512, batch 8, float32) as a Llama with every layer MoE: 8 SwiGLU
experts of width 1408 (each ≈ bench_cpu's GELU MLP of width 2048 in parameters), top-2."""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "bench_cpu_moe"
    c.steps = 20
    c.model.family = "llama"
    c.model.d_model = 512
    c.model.num_layers = 8
    c.model.num_heads = 8
    c.model.mlp_dim = 1408
    c.model.vocab_size = 32000
    c.model.seq_len = 512
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.train.global_batch = 8
    c.train.precision = "float32"
    c.data.source = "synthetic"
    return c
