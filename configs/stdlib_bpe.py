"""Worked example (docs/data.md): a BPE trained on the stdlib corpus, each file one document
packed into rows with a document mask, and a small GPT-2 trained on it; a few minutes on a
laptop CPU.

    jaxtrain prepare --stdlib --train-tokenizer 4096 --out data/stdlib_bpe
    jaxtrain train --config configs/stdlib_bpe.py
    jaxtrain generate --workdir runs/stdlib_bpe --prompt "def parse("
"""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.name = "stdlib_bpe"
    c.steps = 300
    c.log_every_steps = 10
    c.eval_every_steps = 100
    c.model.family = "gpt2"
    c.model.d_model = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.mlp_dim = 512
    c.model.vocab_size = 4096  # the trained BPE's
    c.model.seq_len = 128  # ≈ 440 bytes of code at ≈ 3.4 bytes per token
    c.train.global_batch = 32
    c.optimizer.lr = 3e-3
    c.optimizer.warmup_steps = 30
    c.data.source = "prepared"
    c.data.path = "data/stdlib_bpe"
    # Each file one document, packed into rows with a document mask: no token attends
    # across a file boundary, and positions restart at each file.
    c.data.packing = "documents"
    c.checkpoint.every_steps = 100
    return c
