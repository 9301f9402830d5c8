"""Not a run of its own: continued pre-training, or a full fine-tune, of released weights
(gemma3_12b, qwen3_8b, qwen3_30b_a3b, gpt_oss_20b): _cluster.py's run for 20K steps at
lr 1e-5 after 200 warmup steps, 64 rows a step as 4 micro-batches, an eval every 500 steps.
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_cluster.py"))
    c.steps = 20_000
    c.eval_every_steps = 500
    c.train.global_batch = 64
    c.train.microbatches = 4
    c.optimizer.lr = 1e-5
    c.optimizer.warmup_steps = 200
    return c
