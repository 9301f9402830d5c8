"""gpt-oss-20b's shape (`openai/gpt-oss-20b`: 21B parameters, 3.6B active; 24 layers
alternating sliding (window 128) and full attention with learned sinks, 32 experts of 2880,
4 a token, the clamped SwiGLU, YaRN ×32 over 4096) on 2 nodes of 8 H100/H200: experts over
`expert`=8 within a node, FSDP over the 2 nodes, bf16, full remat, 4096-token rows.

The sinks run in the chunked kernel ('auto' where cuDNN cannot: scaffold.with_sinks), which
keeps no L×L scores. The alternating pattern walks as one scan over its 12 periods
(models/stack.py). Import with `jaxtrain convert --from-hf openai/gpt-oss-20b` after
dequantizing its MXFP4 experts to bf16 (docs/interop.md).
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "gpt_oss_20b"
    c.steps = 20_000
    c.log_every_steps = 10
    c.eval_every_steps = 500
    c.eval_batches = 8
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.expert = 8
    c.model.family = "gpt_oss"
    c.model.d_model = 2880
    c.model.num_layers = 24
    c.model.num_heads = 64
    c.model.num_kv_heads = 8
    c.model.head_dim = 64
    c.model.mlp_dim = 2880
    c.model.vocab_size = 201088
    c.model.seq_len = 4096
    c.model.rope_theta = 150000.0
    c.model.rope_scaling.type = "yarn"
    c.model.rope_scaling.factor = 32.0
    c.model.rope_scaling.original_max_position_embeddings = 4096
    c.model.norm_eps = 1e-5
    c.model.layer_types = "sliding,full"
    c.model.sliding_window = 128
    c.model.remat = "full"
    c.model.moe.num_experts = 32
    c.model.moe.top_k = 4
    c.model.moe.expert_mlp_dim = 2880
    c.model.moe.aux_loss_weight = 0.0
    c.train.global_batch = 64
    c.train.microbatches = 4
    c.train.precision = "bfloat16"
    c.optimizer.lr = 1e-5
    c.optimizer.warmup_steps = 200
    c.data.source = "bin"
    c.data.path = "data/corpus"
    c.checkpoint.every_steps = 500
    return c
