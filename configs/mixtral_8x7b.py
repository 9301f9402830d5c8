"""Mixtral-8x7B's shape (46.7B parameters, 12.9B active per token) for a TPU v5p-128 slice
(64 chips) or 8 nodes of 8 H100/H200: experts over `expert`=8, everything else FSDP over
`fsdp`=8, bf16, full remat, 1M-token batches (256 × 4096) as 4 micro-batches.

Checked without hardware by an AOT compile for the TPU topology (docs/benchmarks.md):
    python -m jaxtrain.plan.calibrate.tpu_aot_check --topology v5p:4x4x4 --cases mixtral_8x7b
On GPUs, mesh.dcn_fsdp=8 puts FSDP across the nodes and the expert all-to-all within one.
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "mixtral_8x7b"
    c.steps = 250_000
    c.log_every_steps = 10
    c.eval_every_steps = 1000
    c.eval_batches = 8
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.expert = 8
    c.model.family = "llama"
    c.model.d_model = 4096
    c.model.num_layers = 32
    c.model.num_heads = 32
    c.model.num_kv_heads = 8
    c.model.mlp_dim = 14336
    c.model.vocab_size = 32000
    c.model.seq_len = 4096
    c.model.rope_theta = 1e6
    c.model.remat = "full"
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.aux_loss_weight = 0.02  # transformers' router_aux_loss_coef 0.01 (×top_k)
    c.train.global_batch = 256
    c.train.microbatches = 4
    c.train.precision = "bfloat16"
    c.optimizer.lr = 1e-4
    c.optimizer.warmup_steps = 2000
    c.data.source = "bin"
    c.data.path = "data/pile"
    c.checkpoint.every_steps = 500
    return c
