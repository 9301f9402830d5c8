"""The main job: a small GPT-2 on the built-in stdlib byte corpus; minutes on a laptop CPU."""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "tiny"
    c.steps = 500
    c.log_every_steps = 5
    c.eval_every_steps = 100
    c.model.update(family="gpt2", d_model=128, num_layers=4, num_heads=4, mlp_dim=512,
                   vocab_size=256, seq_len=128)
    c.train.global_batch = 32
    c.optimizer.lr = 3e-3
    c.optimizer.warmup_steps = 50
    c.optimizer.weight_decay = 0.1
    c.checkpoint.every_steps = 200
    return c
