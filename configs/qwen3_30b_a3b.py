"""Qwen3-30B-A3B's shape (30.5B parameters, 3.3B active per token: `Qwen/Qwen3-30B-A3B`'s
config.json: 128 experts of 768, 8 a token, every layer MoE, normalised top-k) on 2 nodes of
8 H100/H200: experts over `expert`=8 within a node, FSDP over the 2 nodes, bf16, full remat,
4096-token rows, 64 a step.

Import with `jaxtrain convert --from-hf Qwen/Qwen3-30B-A3B` (docs/interop.md).
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "qwen3_30b_a3b"
    c.steps = 20_000
    c.log_every_steps = 10
    c.eval_every_steps = 500
    c.eval_batches = 8
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.expert = 8
    c.model.family = "qwen3"
    c.model.d_model = 2048
    c.model.num_layers = 48
    c.model.num_heads = 32
    c.model.num_kv_heads = 4
    c.model.head_dim = 128
    c.model.mlp_dim = 6144
    c.model.vocab_size = 151936
    c.model.seq_len = 4096
    c.model.rope_theta = 1e6
    c.model.norm_eps = 1e-6
    c.model.remat = "full"
    c.model.moe.num_experts = 128
    c.model.moe.top_k = 8
    c.model.moe.expert_mlp_dim = 768
    c.model.moe.norm_topk_prob = True
    c.model.moe.aux_loss_weight = 0.008  # transformers' router_aux_loss_coef 0.001 (×top_k)
    c.train.global_batch = 64
    c.train.microbatches = 4
    c.train.precision = "bfloat16"
    c.optimizer.lr = 1e-5
    c.optimizer.warmup_steps = 200
    c.data.source = "bin"
    c.data.path = "data/corpus"
    c.checkpoint.every_steps = 500
    return c
