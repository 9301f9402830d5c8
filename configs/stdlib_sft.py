"""Worked example (docs/finetune.md): LoRA chat SFT of the stdlib BPE model
(configs/stdlib_bpe.py, docs/data.md) on docstring -> function chats made from the same
corpus, trained on the answers only; a few minutes on a laptop CPU.

    python scripts/make_instructions.py --out data/instructions
    jaxtrain prepare data/instructions/sft.jsonl --chat \
        --chat-template data/instructions/chat_template.jinja \
        --tokenizer data/stdlib_bpe/tokenizer --max-length 129 --max-bad-fraction 0.2 \
        --out data/stdlib_sft
    jaxtrain train --config configs/stdlib_sft.py
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("stdlib_bpe.py"))
    c.name = "stdlib_sft"
    c.steps = 150
    c.eval_every_steps = 50
    c.eval_batches = 4  # the held-out tail holds 4 batches of 16 rows
    c.data.path = "data/stdlib_sft"
    c.data.val_fraction = 0.1  # ≈ 100 held-out chats: the answers' loss is the eval loss
    c.train.global_batch = 16
    c.optimizer.lr = 2e-3
    c.optimizer.warmup_steps = 10
    # Adapters on every attention projection and the MLP; the base is the stdlib_bpe run.
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.model.lora.targets = "q,k,v,o,up,down"
    c.model.lora.base = "runs/stdlib_bpe"
    c.checkpoint.every_steps = 50
    return c
