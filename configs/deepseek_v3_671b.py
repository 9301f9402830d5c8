"""DeepSeek-V3's shape (671B parameters, 37B active per token: `deepseek-ai/DeepSeek-V3`'s
config.json) on 1024 H100s (128 nodes of 8): experts over `expert`=32, every weight FSDP
over `fsdp`=32, bf16, full remat, 4096-token rows, 4096 a step (16.8M tokens) as 2
micro-batches of two rows a device (the report ramps from 3072 to 15360 rows). On 256
H100s or H200s it does not fit (float32 weights and Adam moments alone are 42 GB a device
there, and the non-expert weights are sharded over `fsdp` only); the plan is in
docs/benchmarks.md. The rest of the run is _cluster.py's.

The parts: multi-head latent attention (128 heads, kv latent 512, q bottleneck 1536, 128
nope + 64 rotary q/k dims, v 128: 576 cached numbers per token and layer against 32,768
for MHA of 128 × 128), the first 3 layers dense (SwiGLU 18432), then 58 MoE layers of 256
routed experts of 2048 in 8 groups (8 a token from its 4 best groups) plus 1 shared, the
sigmoid router balanced by its correction bias (γ 0.001, no aux loss), one MTP depth at
weight 0.3. The pipeline axis is not used: it splits the MoE groups and has no place yet
for the dense prefix (docs/parallelism.md).

    jaxtrain plan --config configs/deepseek_v3_671b.py --hardware H100-SXM --devices 1024

Import with `jaxtrain convert --from-hf deepseek-ai/DeepSeek-V3` (docs/interop.md) after
setting model.mtp.depths=0 (the import reads no MTP weights); its YaRN RoPE maps as
model.rope_scaling (yarn) and model.mla.softmax_scale.
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("_cluster.py"))
    c.name = "deepseek_v3_671b"
    c.steps = 100_000
    c.eval_every_steps = 1000
    c.mesh.expert = 32
    c.model.update(family="deepseek_v3", d_model=7168, num_layers=61, num_heads=128,
                   mlp_dim=18432, vocab_size=129280, seq_len=4096, norm_eps=1e-6)
    c.model.mla.update(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                       qk_rope_head_dim=64, v_head_dim=128)
    c.model.moe.update(num_experts=256, top_k=8, expert_mlp_dim=2048, shared_experts=1,
                       first_dense_layers=3, router="sigmoid_bias", n_group=8, topk_group=4,
                       routed_scaling_factor=2.5, bias_update_rate=0.001,
                       aux_loss_weight=0.0, z_loss_weight=0.0)
    c.model.mtp.update(depths=1, loss_weight=0.3)
    c.train.global_batch = 4096
    c.train.microbatches = 2
    c.optimizer.lr = 2.2e-4
    c.optimizer.warmup_steps = 2000
    return c
