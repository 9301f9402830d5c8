"""tiny.py's job (the stdlib byte corpus, 4 layers × 128) with the qwen3 family's parts
(RMSNorm, SwiGLU, RoPE, GQA, per-head q/k RMSNorm): the docs' CPU example of a family made
of parts (docs/architecture.md)."""

from jaxtrain.config import base_config


def get_config():
    c = base_config()
    c.steps = 500
    c.log_every_steps = 5
    c.eval_every_steps = 100
    c.model.d_model = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.vocab_size = 256
    c.model.seq_len = 128
    c.train.global_batch = 32
    c.optimizer.lr = 3e-3
    c.optimizer.warmup_steps = 50
    c.optimizer.weight_decay = 0.1
    c.checkpoint.every_steps = 200
    c.name = "tiny_qwen3"
    c.model.family = "qwen3"
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 352  # SwiGLU's three matrices ≈ GELU's two of 512
    c.model.norm_eps = 1e-6
    return c
