"""A 1.2B Llama-style model at seq 2048, bf16: one H100/H200, or FSDP over a GPU node."""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "llama_1b"
    c.steps = 100_000
    c.log_every_steps = 20
    c.eval_every_steps = 1000
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.model.update(family="llama", d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                   mlp_dim=8192, vocab_size=32000, seq_len=2048)
    c.model.remat = "save_dots"
    c.train.global_batch = 8
    c.train.precision = "bfloat16"
    c.optimizer.lr = 3e-4
    c.optimizer.warmup_steps = 2000
    c.data.source = "synthetic"
    c.checkpoint.every_steps = 1000
    return c
