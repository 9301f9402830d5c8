"""gpt-oss-20b's shape (`openai/gpt-oss-20b`: 21B parameters, 3.6B active; 24 layers
alternating sliding (window 128) and full attention with learned sinks, 32 experts of 2880,
4 a token, the clamped SwiGLU, YaRN ×32 over 4096) on 2 nodes of 8 H100/H200: experts over
`expert`=8 within a node, FSDP over the 2 nodes, bf16, full remat, 4096-token rows
(the run: _continued.py).

The sinks run in the chunked kernel ('auto' where cuDNN cannot: scaffold.with_sinks), which
keeps no L×L scores. The alternating pattern walks as one scan over its 12 periods
(models/stack.py). Import with `jaxtrain convert --from-hf openai/gpt-oss-20b` after
dequantizing its MXFP4 experts to bf16 (docs/interop.md).
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_continued.py"))
    c.name = "gpt_oss_20b"
    c.mesh.expert = 8
    c.model.update(family="gpt_oss", d_model=2880, num_layers=24, num_heads=64, num_kv_heads=8,
                   head_dim=64, mlp_dim=2880, vocab_size=201088, seq_len=4096,
                   rope_theta=150000.0, norm_eps=1e-5, layer_types="sliding,full",
                   sliding_window=128)
    c.model.rope_scaling.update(type="yarn", factor=32.0,
                                original_max_position_embeddings=4096)
    c.model.moe.update(num_experts=32, top_k=4, expert_mlp_dim=2880, aux_loss_weight=0.0)
    return c
