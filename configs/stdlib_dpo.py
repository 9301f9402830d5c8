"""Worked example (docs/finetune.md): DPO of the SFT'd stdlib model (configs/stdlib_sft.py,
its adapters merged into a run of their own) on pairs of the real function against a
corrupted one, with new LoRA adapters of stdlib_sft.py's shape (and its 16-row batches and
held-out tenth): the merged model, frozen, is the reference.

    jaxtrain prepare data/instructions/preference.jsonl --preference \
        --chat-template data/instructions/chat_template.jinja \
        --tokenizer data/stdlib_bpe/tokenizer --max-length 129 --max-bad-fraction 0.2 \
        --out data/stdlib_dpo
    jaxtrain convert --to-hf hf/stdlib_sft --workdir runs/stdlib_sft
    jaxtrain convert --from-hf hf/stdlib_sft --config configs/stdlib_bpe.py \
        --workdir runs/stdlib_sft_merged
    jaxtrain train --config configs/stdlib_dpo.py
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("stdlib_sft.py"))
    c.name = "stdlib_dpo"
    c.steps = 60
    c.eval_every_steps = 20
    c.eval_batches = 1  # ≈ 24 held-out pairs: one batch of 16
    c.data.path = "data/stdlib_dpo"
    c.data.packing = "pairs"  # row k: [prompt + chosen][prompt + rejected]
    c.train.objective = "dpo"
    c.train.dpo.beta = 0.1
    c.optimizer.lr = 2e-4  # DPO wants a gentle push: at 1e-3 the replies degenerate
    c.optimizer.warmup_steps = 5
    c.model.lora.base = "runs/stdlib_sft_merged"
    c.checkpoint.every_steps = 20
    return c
