"""Mixtral-8x7B's shape (46.7B parameters, 12.9B active per token) for a TPU v5p-128 slice
(64 chips) or 8 nodes of 8 H100/H200: experts over `expert`=8, everything else FSDP over
`fsdp`=8, bf16, full remat, 1M-token batches (256 × 4096) as 4 micro-batches (the run:
_pile.py).

Checked without hardware by an AOT compile for the TPU topology (docs/benchmarks.md):
    python -m jaxtrain.plan.calibrate.tpu_aot_check --topology v5p:4x4x4 --cases mixtral_8x7b
On GPUs, mesh.dcn_fsdp=8 puts FSDP across the nodes and the expert all-to-all within one.
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_pile.py"))
    c.name = "mixtral_8x7b"
    c.mesh.expert = 8
    c.model.update(family="llama", d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                   mlp_dim=14336, vocab_size=32000, seq_len=4096, rope_theta=1e6)
    c.model.moe.update(num_experts=8, top_k=2)
    c.model.moe.aux_loss_weight = 0.02  # transformers' router_aux_loss_coef 0.01 (×top_k)
    c.train.global_batch = 256
    c.train.microbatches = 4
    return c
