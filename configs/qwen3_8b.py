"""Qwen3-8B's shape (8.2B parameters: `Qwen/Qwen3-8B`'s config.json) for continued
pre-training or a full fine-tune on one node of 8 H100/H200: FSDP over the 8 GPUs, bf16,
full remat, 4096-token rows, 64 a step (256K tokens).

Start from the released weights with `jaxtrain convert --from-hf Qwen/Qwen3-8B`
(docs/interop.md); its size here is checked by tests/unit/test_plan.py's compile on 8 fake devices.
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "qwen3_8b"
    c.steps = 20_000
    c.log_every_steps = 10
    c.eval_every_steps = 500
    c.eval_batches = 8
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.model.family = "qwen3"
    c.model.d_model = 4096
    c.model.num_layers = 36
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.head_dim = 128
    c.model.mlp_dim = 12288
    c.model.vocab_size = 151936
    c.model.seq_len = 4096
    c.model.rope_theta = 1e6
    c.model.norm_eps = 1e-6
    c.model.remat = "full"
    c.train.global_batch = 64
    c.train.microbatches = 8
    c.train.precision = "bfloat16"
    c.optimizer.lr = 1e-5
    c.optimizer.warmup_steps = 200
    c.data.source = "bin"
    c.data.path = "data/corpus"
    c.checkpoint.every_steps = 500
    return c
