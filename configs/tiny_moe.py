"""A small Mixtral-style MoE on the built-in stdlib byte corpus; minutes on a laptop CPU.

Llama family, 4 layers, d_model 128, every layer MoE: 8 SwiGLU experts of width 256, top-2,
so each token uses a SwiGLU of width 512 (≈ the active parameters of a dense llama with
mlp_dim 512: `--config.model.moe.num_experts=0` is that model) out of 8 × 256 in total.
docs/benchmarks.md compares the two (scripts/moe_tiny_compare.py).
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "tiny_moe"
    c.steps = 500
    c.log_every_steps = 5
    c.eval_every_steps = 100
    c.model.family = "llama"
    c.model.d_model = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 512  # the dense model of the same active parameters
    c.model.vocab_size = 256
    c.model.seq_len = 128
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.expert_mlp_dim = 256
    c.train.global_batch = 32
    c.optimizer.lr = 3e-3
    c.optimizer.warmup_steps = 50
    c.optimizer.weight_decay = 0.1
    c.checkpoint.every_steps = 200
    return c
