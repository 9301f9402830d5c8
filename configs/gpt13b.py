"""A 13B GPT for 64 A100-80GB (8 nodes × 8) or a TPU v5p-128 slice: bf16, FSDP × tensor
parallel (tensor=8 within a node), full remat, 1M-token batches as 8 micro-batches (the run:
_pile.py)."""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_pile.py"))
    c.name = "gpt13b"
    c.mesh.tensor = 8
    c.mesh.sequence_parallel = True
    c.model.update(family="gpt2", d_model=5120, num_layers=40, num_heads=40, mlp_dim=20480,
                   vocab_size=50304, seq_len=2048)
    c.train.global_batch = 512
    c.train.microbatches = 8
    return c
