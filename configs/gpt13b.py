"""A 13B GPT for 64 A100-80GB (8 nodes × 8) or a TPU v5p-128 slice: bf16, FSDP × tensor
parallel (tensor=8 within a node), full remat, 1M-token batches as 8 micro-batches."""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "gpt13b"
    c.steps = 250_000
    c.log_every_steps = 10
    c.eval_every_steps = 1000
    c.eval_batches = 8
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 8
    c.mesh.sequence_parallel = True
    c.model.family = "gpt2"
    c.model.d_model = 5120
    c.model.num_layers = 40
    c.model.num_heads = 40
    c.model.mlp_dim = 20480
    c.model.vocab_size = 50304
    c.model.seq_len = 2048
    c.model.remat = "full"
    c.train.global_batch = 512
    c.train.microbatches = 8
    c.train.precision = "bfloat16"
    c.optimizer.lr = 1e-4
    c.optimizer.warmup_steps = 2000
    c.data.source = "bin"
    c.data.path = "data/pile"
    c.checkpoint.every_steps = 500
    return c
