"""Not a run of its own: what the multi-node configs share (gemma3_12b, qwen3_8b,
qwen3_30b_a3b, gpt_oss_20b through _continued.py, gpt13b and mixtral_8x7b through _pile.py,
and deepseek_v3_671b): FSDP over every device (`fsdp`=-1, `data`=1), bf16, full remat,
token .bin data from data/corpus, a log line every 10 steps, 8 eval batches and a checkpoint
every 500 steps. Each adds its model, its batch, its schedule and its other mesh axes.
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.log_every_steps = 10
    c.eval_batches = 8
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.model.remat = "full"
    c.train.precision = "bfloat16"
    c.data.source = "bin"
    c.data.path = "data/corpus"
    c.checkpoint.every_steps = 500
    return c
