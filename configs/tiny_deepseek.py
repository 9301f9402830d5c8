"""A small DeepSeek-V3-style model on the built-in stdlib byte corpus; minutes on a laptop CPU.

deepseek_v3 family, 4 layers, d_model 128: multi-head latent attention (4 heads, a kv latent
of 64, q through a rank-64 bottleneck, 16 nope + 16 rotary q/k dims, v 32); the first layer
dense (SwiGLU 512), the other three MoE: 16 fine-grained SwiGLU experts of width 128 in 4
groups (a token's 3 experts come from its 2 best groups) plus one shared expert, so each
token uses (3 + 1) × 128 = 512 of expert width, configs/tiny_moe.py's active width. The
sigmoid router is balanced by its correction bias (γ = 0.001), with no aux loss.
docs/benchmarks.md compares the two (scripts/bench_moe_tiny.py).
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("tiny.py"))
    c.name = "tiny_deepseek"
    c.model.family = "deepseek_v3"
    c.model.mlp_dim = 512  # the dense first layer
    c.model.mla.kv_lora_rank = 64
    c.model.mla.q_lora_rank = 64
    c.model.mla.qk_nope_head_dim = 16
    c.model.mla.qk_rope_head_dim = 16
    c.model.mla.v_head_dim = 32
    c.model.moe.num_experts = 16
    c.model.moe.top_k = 3
    c.model.moe.expert_mlp_dim = 128
    c.model.moe.shared_experts = 1
    c.model.moe.first_dense_layers = 1
    c.model.moe.router = "sigmoid_bias"
    c.model.moe.n_group = 4
    c.model.moe.topk_group = 2
    c.model.moe.bias_update_rate = 0.001
    c.model.moe.aux_loss_weight = 0.0
    c.model.moe.z_loss_weight = 0.0
    return c
