"""Not a run of its own: pre-training from scratch on The Pile's tokens (data/pile) with
_cluster.py's run (gpt13b, mixtral_8x7b): 250K steps at lr 1e-4 after 2000 warmup steps, an
eval every 1000 steps. Each config sets its batch (1M tokens a step in both).
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_cluster.py"))
    c.steps = 250_000
    c.eval_every_steps = 1000
    c.optimizer.lr = 1e-4
    c.optimizer.warmup_steps = 2000
    c.data.path = "data/pile"
    return c
