"""llama_1b at 32k tokens on one 8-GPU node (H100/H200): the sequence split over context=8
(all-gathered K/V under its grouped-query heads, zig-zag load balance), RoPE scaled
Llama-3-style from llama_1b's 2048-token pretraining length, full remat. Plans and
compile checks: docs/parallelism.md, "Context vs tensor sequence parallelism"."""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("llama_1b.py"))
    c.name = "llama_1b_32k"
    c.mesh.update(data=1, fsdp=1, context=8, context_load_balance=True)
    c.model.update(seq_len=32768, context_attention="auto", rope_theta=500000.0, remat="full")
    c.model.rope_scaling.update(type="llama3", factor=16.0,  # 32768 / 2048
                                original_max_position_embeddings=2048)
    c.train.global_batch = 8  # 256k tokens a step; each device 4096 positions of every row
    return c
