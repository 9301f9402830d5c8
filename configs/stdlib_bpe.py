"""Worked example (docs/data.md): a BPE trained on the stdlib corpus, each file one document
packed into rows with a document mask, and tiny.py's small GPT-2 trained on it; a few
minutes on a laptop CPU.

    jaxtrain prepare --stdlib --train-tokenizer 4096 --out data/stdlib_bpe
    jaxtrain train --config configs/stdlib_bpe.py
    jaxtrain generate --workdir runs/stdlib_bpe --prompt "def parse("
"""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("tiny.py"))
    c.name = "stdlib_bpe"
    c.steps = 300
    c.log_every_steps = 10
    c.model.vocab_size = 4096  # the trained BPE's
    c.model.seq_len = 128  # ≈ 440 bytes of code at ≈ 3.4 bytes per token
    c.optimizer.warmup_steps = 30
    c.data.source = "prepared"
    c.data.path = "data/stdlib_bpe"
    # Each file one document, packed into rows with a document mask: no token attends
    # across a file boundary, and positions restart at each file.
    c.data.packing = "documents"
    c.checkpoint.every_steps = 100
    return c
