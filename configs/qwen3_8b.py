"""Qwen3-8B's shape (8.2B parameters: `Qwen/Qwen3-8B`'s config.json) for continued
pre-training or a full fine-tune on one node of 8 H100/H200: FSDP over the 8 GPUs, bf16,
full remat, 4096-token rows, 64 a step (256K tokens) as 8 micro-batches (the run:
_continued.py's, with twice its micro-batches).

Start from the released weights with `jaxtrain convert --from-hf Qwen/Qwen3-8B`
(docs/interop.md); its size here is checked by tests/unit/test_plan.py's compile on 8 fake devices.
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_continued.py"))
    c.name = "qwen3_8b"
    c.model.update(family="qwen3", d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                   head_dim=128, mlp_dim=12288, vocab_size=151936, seq_len=4096,
                   rope_theta=1e6, norm_eps=1e-6)
    c.train.microbatches = 8
    return c
