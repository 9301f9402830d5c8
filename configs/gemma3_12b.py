"""Gemma-3-12B's text model (`google/gemma-3-12b-pt`, `gemma3_text`: 48 layers, 5 sliding
(window 1024, rope 10K) to 1 full (rope 1M), query_pre_attn_scalar 256, a 262K vocabulary,
tied) on 2 nodes of 8 H100/H200: FSDP over the 16 GPUs, bf16, full remat, 4096-token rows
(the run: _continued.py).

The pattern walks as one scan over its 8 periods (models/stack.py): 2 compiled layer
bodies. Import with `jaxtrain convert --from-hf google/gemma-3-12b-pt` (docs/interop.md).
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_continued.py"))
    c.name = "gemma3_12b"
    c.model.update(family="gemma3", d_model=3840, num_layers=48, num_heads=16, num_kv_heads=8,
                   head_dim=256, mlp_dim=15360, vocab_size=262208, seq_len=4096,
                   rope_theta=1e6, rope_local_theta=10000.0, norm_eps=1e-6,
                   attention_scale_dim=256, sliding_window=1024,
                   layer_types="sliding,sliding,sliding,sliding,sliding,full")
    return c
