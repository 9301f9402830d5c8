"""tiny.py's job (the stdlib byte corpus, 4 layers × 128) with the gemma3 family's parts
((1 + w) RMSNorm, sandwich norms, q/k norm, GeGLU, sqrt(d) embedding scale, tied head), a
query_pre_attn_scalar unlike head_dim and a final-logit soft-cap: the docs' CPU example of
Gemma 3's parts (docs/interop.md)."""

import pathlib

from jaxtrain.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("tiny.py"))
    c.name = "tiny_gemma3"
    c.model.update(family="gemma3", num_kv_heads=2, norm_eps=1e-6, attention_scale_dim=64,
                   final_logit_softcap=30.0)
    c.model.mlp_dim = 352  # GeGLU's three matrices ≈ GELU's two of 512
    return c
