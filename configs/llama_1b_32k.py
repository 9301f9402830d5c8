"""llama_1b at 32k tokens on one 8-GPU node (H100/H200): the sequence split over context=8
(all-gathered K/V under its grouped-query heads, zig-zag load balance), RoPE scaled
Llama-3-style from llama_1b's 2048-token pretraining length, full remat. Plans and
compile checks: docs/parallelism.md, "Context vs tensor sequence parallelism"."""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("llama_1b.py"))
    c.name = "llama_1b_32k"
    c.mesh.data = 1
    c.mesh.fsdp = 1
    c.mesh.context = 8
    c.mesh.context_load_balance = True
    c.model.seq_len = 32768
    c.model.context_attention = "auto"
    c.model.rope_scaling.type = "llama3"
    c.model.rope_scaling.factor = 16.0  # 32768 / 2048
    c.model.rope_scaling.original_max_position_embeddings = 2048
    c.model.rope_theta = 500000.0
    c.model.remat = "full"
    c.train.global_batch = 8  # 256k tokens a step; each device 4096 positions of every row
    return c
