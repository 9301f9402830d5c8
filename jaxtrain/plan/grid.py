"""The grid of small models × meshes × remat policies on which the memory model is checked
against XLA's compiled step (tests/unit/test_plan.py, plan/calibrate/plan_vs_compiler.py): 8
devices, models small enough that each compile takes seconds on a CPU."""

from __future__ import annotations

from jaxtrain.config import apply_overrides, base_config

SIZES = {
    # d_model, layers, heads, kv heads, mlp, vocab, seq
    "S": (64, 2, 8, 0, 256, 512, 64),
    "M": (128, 4, 8, 0, 512, 1024, 128),
    "L": (256, 4, 8, 0, 1024, 2048, 128),
}

_MOE = {"model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.expert_mlp_dim": 256}

# name -> (family, size, batch, {dotted overrides})
GRID = {
    "S gpt2 data=8": ("gpt2", "S", 32, {"mesh.data": 8}),
    "S gpt2 fsdp=8": ("gpt2", "S", 32, {"mesh.fsdp": 8}),
    "M gpt2 tensor=8": ("gpt2", "M", 16, {"mesh.tensor": 8}),
    "M gpt2 fsdp=2 tensor=4 sp": ("gpt2", "M", 16, {"mesh.fsdp": 2, "mesh.tensor": 4,
                                                    "mesh.sequence_parallel": True}),
    "M gpt2 data=2 fsdp=2 tensor=2 full": ("gpt2", "M", 32, {
        "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "model.remat": "full"}),
    "M gpt2 fsdp=8 full": ("gpt2", "M", 32, {"mesh.fsdp": 8, "model.remat": "full"}),
    "M gpt2 fsdp=8 save_dots": ("gpt2", "M", 32, {"mesh.fsdp": 8,
                                                  "model.remat": "save_dots"}),
    "M gpt2 fsdp=4 tensor=2 save_dots bf16": ("gpt2", "M", 32, {
        "mesh.fsdp": 4, "mesh.tensor": 2, "model.remat": "save_dots",
        "train.precision": "bfloat16"}),
    "M gpt2 pipeline=2 fsdp=4 gpipe m=4": ("gpt2", "M", 32, {
        "mesh.pipeline": 2, "mesh.fsdp": 4, "pipeline.microbatches": 4}),
    "M gpt2 pipeline=2 data=4 circular full": ("gpt2", "M", 32, {
        "mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "circular",
        "pipeline.repeats": 2, "pipeline.microbatches": 4, "model.remat": "full"}),
    "M llama fsdp=4 tensor=2": ("llama", "M", 32, {"mesh.fsdp": 4, "mesh.tensor": 2}),
    "M llama data=8 micro=2 bf16 full": ("llama", "M", 32, {
        "mesh.data": 8, "train.microbatches": 2, "train.precision": "bfloat16",
        "model.remat": "full"}),
    "L gpt2 fsdp=8 bf16": ("gpt2", "L", 32, {"mesh.fsdp": 8, "train.precision": "bfloat16"}),
    "L gpt2 data=2 tensor=4 sp save_dots": ("gpt2", "L", 16, {
        "mesh.data": 2, "mesh.tensor": 4, "mesh.sequence_parallel": True,
        "model.remat": "save_dots"}),
    # Mixture of experts (8 experts of width 256, top-2), both dispatch paths.
    "M llama moe expert=8 capacity": ("llama", "M", 32, {**_MOE, "mesh.expert": 8,
                                                         "model.moe.dispatch": "capacity"}),
    "M llama moe expert=4 data=2 dropless full": ("llama", "M", 32, {
        **_MOE, "mesh.expert": 4, "mesh.data": 2, "model.moe.dispatch": "dropless",
        "model.remat": "full"}),
    # A second dropless expert-parallel layout: alone, the row above was the only one whose
    # peak is the MoE layer's working set, so a fit without it (the held-out check) could
    # put that factor anywhere.
    "M llama moe expert=2 fsdp=4 dropless full": ("llama", "M", 32, {
        **_MOE, "mesh.expert": 2, "mesh.fsdp": 4, "model.moe.dispatch": "dropless",
        "model.remat": "full"}),
}
MOE_CASES = tuple(name for name, case in GRID.items() if "model.moe.num_experts" in case[3])


# Each shipped config (configs/) on the target its docstring names, the smallest device it
# claims: (hardware catalog entry, devices). tests/unit/test_plan.py checks none OOMs there;
# plan/calibrate/memory_check.py compares the estimate with XLA on them.
SHIPPED_TARGETS = {"tiny.py": ("CPU-host", 1), "bench_cpu.py": ("CPU-host", 1),
                   "stdlib_bpe.py": ("CPU-host", 1), "stdlib_sft.py": ("CPU-host", 1),
                   "stdlib_dpo.py": ("CPU-host", 1),
                   "gpt2_124m.py": ("A100-40GB", 8), "llama_1b.py": ("H100-SXM", 8),
                   "llama_1b_32k.py": ("H100-SXM", 8),
                   "gpt13b.py": ("A100-80GB", 64), "gpt13b_pp.py": ("A100-80GB", 16),
                   "tiny_moe.py": ("CPU-host", 1), "bench_cpu_moe.py": ("CPU-host", 1),
                   "tiny_qwen3.py": ("CPU-host", 1), "tiny_gemma3.py": ("CPU-host", 1),
                   "tiny_qwen3_5.py": ("CPU-host", 1),
                   "mixtral_8x7b.py": ("TPU-v5p", 64), "qwen3_8b.py": ("H100-SXM", 8),
                   "qwen3_30b_a3b.py": ("H100-SXM", 16), "gemma3_12b.py": ("H100-SXM", 16),
                   "gpt_oss_20b.py": ("H100-SXM", 16), "tiny_deepseek.py": ("CPU-host", 1),
                   "deepseek_v3_671b.py": ("H100-SXM", 1024)}
MOE_CONFIGS = ("tiny_moe.py", "bench_cpu_moe.py", "mixtral_8x7b.py", "qwen3_30b_a3b.py",
               "gpt_oss_20b.py", "tiny_deepseek.py", "deepseek_v3_671b.py")
# Configs whose memory check compiles a reduced-depth variant (a full compile on their
# device count takes too long on a 2-core CPU): the same per-device shapes, fewer layers of
# each kind. The estimate is checked on the same variant; plans quote the full depth.
SHIPPED_OVERRIDES = {"deepseek_v3_671b.py": {"model.num_layers": 4,
                                             "model.moe.first_dense_layers": 1}}


def grid_config(name: str):
    family, size, batch, overrides = GRID[name]
    d, layers, heads, kv, mlp, vocab, seq = SIZES[size]
    c = base_config()
    c.data.source = "synthetic"
    c.model.update(family=family, d_model=d, num_layers=layers, num_heads=heads,
                   num_kv_heads=kv or (heads // 2 if family == "llama" else 0), mlp_dim=mlp,
                   vocab_size=vocab, seq_len=seq)
    c.train.global_batch = batch
    c.mesh.data = 1
    return apply_overrides(c, overrides)
