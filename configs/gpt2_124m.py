"""GPT-2 small (124M) on nanoGPT-style OpenWebText tokens, for one 8-GPU node (A100/H100).

Prepare data/openwebtext/{train,val}.bin (uint16 GPT-2 BPE tokens) as nanoGPT's
data/openwebtext/prepare.py does, or point --config.data.path elsewhere.
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "gpt2_124m"
    c.steps = 600_000
    c.log_every_steps = 50
    c.eval_every_steps = 2000
    c.eval_batches = 20
    c.mesh.data = -1
    # GPT-2's vocabulary of 50257 padded to a multiple of 128.
    c.model.update(family="gpt2", d_model=768, num_layers=12, num_heads=12, mlp_dim=3072,
                   vocab_size=50304, seq_len=1024)
    c.train.global_batch = 480
    c.train.microbatches = 4
    c.train.precision = "bfloat16"
    c.optimizer.lr = 6e-4
    c.optimizer.warmup_steps = 2000
    c.optimizer.weight_decay = 0.1
    c.data.source = "bin"
    c.data.path = "data/openwebtext"
    c.checkpoint.every_steps = 5000
    return c
