"""Gemma-3-12B's text model (`google/gemma-3-12b-pt`, `gemma3_text`: 48 layers, 5 sliding
(window 1024, rope 10K) to 1 full (rope 1M), query_pre_attn_scalar 256, a 262K vocabulary,
tied) on 2 nodes of 8 H100/H200: FSDP over the 16 GPUs, bf16, full remat, 4096-token rows.

The pattern walks as one scan over its 8 periods (models/stack.py): 2 compiled layer
bodies. Import with `jaxtrain convert --from-hf google/gemma-3-12b-pt` (docs/interop.md).
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "gemma3_12b"
    c.steps = 20_000
    c.log_every_steps = 10
    c.eval_every_steps = 500
    c.eval_batches = 8
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.model.family = "gemma3"
    c.model.d_model = 3840
    c.model.num_layers = 48
    c.model.num_heads = 16
    c.model.num_kv_heads = 8
    c.model.head_dim = 256
    c.model.mlp_dim = 15360
    c.model.vocab_size = 262208
    c.model.seq_len = 4096
    c.model.rope_theta = 1e6
    c.model.rope_local_theta = 10000.0
    c.model.norm_eps = 1e-6
    c.model.attention_scale_dim = 256
    c.model.layer_types = "sliding,sliding,sliding,sliding,sliding,full"
    c.model.sliding_window = 1024
    c.model.remat = "full"
    c.train.global_batch = 64
    c.train.microbatches = 4
    c.train.precision = "bfloat16"
    c.optimizer.lr = 1e-5
    c.optimizer.warmup_steps = 200
    c.data.source = "bin"
    c.data.path = "data/corpus"
    c.checkpoint.every_steps = 500
    return c
