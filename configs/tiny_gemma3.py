"""tiny.py's job (the stdlib byte corpus, 4 layers × 128) with the gemma3 family's parts
((1 + w) RMSNorm, sandwich norms, q/k norm, GeGLU, sqrt(d) embedding scale, tied head), a
query_pre_attn_scalar unlike head_dim and a final-logit soft-cap: the docs' CPU example of
Gemma 3's parts (docs/interop.md)."""

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
    c.name = "tiny_gemma3"
    c.model.family = "gemma3"
    c.model.num_kv_heads = 2
    c.model.mlp_dim = 352  # GeGLU's three matrices ≈ GELU's two of 512
    c.model.norm_eps = 1e-6
    c.model.attention_scale_dim = 64
    c.model.final_logit_softcap = 30.0
    return c
