"""Qwen3-30B-A3B's shape (30.5B parameters, 3.3B active per token: `Qwen/Qwen3-30B-A3B`'s
config.json: 128 experts of 768, 8 a token, every layer MoE, normalised top-k) on 2 nodes of
8 H100/H200: experts over `expert`=8 within a node, FSDP over the 2 nodes, bf16, full remat,
4096-token rows, 64 a step (the run: _continued.py).

Import with `jaxtrain convert --from-hf Qwen/Qwen3-30B-A3B` (docs/interop.md).
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_continued.py"))
    c.name = "qwen3_30b_a3b"
    c.mesh.expert = 8
    c.model.update(family="qwen3", d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                   head_dim=128, mlp_dim=6144, vocab_size=151936, seq_len=4096,
                   rope_theta=1e6, norm_eps=1e-6)
    c.model.moe.update(num_experts=128, top_k=8, expert_mlp_dim=768, norm_topk_prob=True)
    c.model.moe.aux_loss_weight = 0.008  # transformers' router_aux_loss_coef 0.001 (×top_k)
    return c
