"""Multi-head latent attention (models/mla.py): against transformers' DeepseekV3Attention
with copied weights, decoding through the latent cache against the full forward, the
kernels that take a v head dim unlike q/k's, and the cache's size against GQA's."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from jaxtrain.config import ConfigError
from jaxtrain.models import ModelSpec
from jaxtrain.models import mla as mla_lib
from jaxtrain.models.attention import cache as decode_cache

D, H, NOPE, ROPE, V, RKV, L = 32, 4, 8, 4, 6, 16, 10


def _hf(q_lora_rank, interleave=True):
    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
                           q_lora_rank=q_lora_rank, kv_lora_rank=RKV, qk_nope_head_dim=NOPE,
                           qk_rope_head_dim=ROPE, v_head_dim=V, rope_interleave=interleave,
                           attn_implementation="eager")
    attn = DeepseekV3Attention(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return cfg, attn


def _hf_forward_grad(cfg, attn, x):
    """transformers' output (a torch tensor that autograd can differentiate)."""
    rotary = DeepseekV3RotaryEmbedding(cfg)
    xt = torch.from_numpy(x)
    cos_sin = rotary(xt, torch.arange(L)[None])
    mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
    return attn(xt, position_embeddings=cos_sin, attention_mask=mask)[0]


def _hf_forward(cfg, attn, x):
    with torch.no_grad():
        return _hf_forward_grad(cfg, attn, x).numpy()


def _mla(q_lora_rank, attention="chunked", interleave=True):
    spec = ModelSpec("llama", D, 2, H, H, NOPE + ROPE, 64, 32, L, attention=attention)
    mla = mla_lib.MlaSpec(RKV, NOPE, ROPE, V, q_lora_rank or 0, interleave)
    return mla_lib.Mla(spec, mla, rngs=nnx.Rngs(0))


def _copied(attn, layer):
    t = lambda w: jnp.asarray(w.detach().numpy())  # noqa: E731
    if layer.mla.q_lora_rank:
        layer.w_q_down[...] = t(attn.q_a_proj.weight).T
        layer.q_norm.scale[...] = t(attn.q_a_layernorm.weight)
        layer.w_q_up[...] = t(attn.q_b_proj.weight).T.reshape(-1, H, NOPE + ROPE)
    else:
        layer.w_q[...] = t(attn.q_proj.weight).T.reshape(D, H, NOPE + ROPE)
    layer.w_kv_down[...] = t(attn.kv_a_proj_with_mqa.weight).T
    layer.kv_norm.scale[...] = t(attn.kv_a_layernorm.weight)
    kv_up = t(attn.kv_b_proj.weight).T.reshape(RKV, H, NOPE + V)
    layer.w_k_up[...], layer.w_v_up[...] = kv_up[..., :NOPE], kv_up[..., NOPE:]
    layer.w_o[...] = t(attn.o_proj.weight).T.reshape(H, V, D)
    return layer


@pytest.mark.parametrize("q_lora_rank, interleave", [(12, True), (None, False)])
def test_mla_equals_transformers_and_decodes_through_the_latent_cache(q_lora_rank, interleave):
    """Low-rank q with DeepSeek's interleaved rotary pairs; full-rank q with rotate-half."""
    x = np.random.default_rng(0).normal(size=(2, L, D)).astype(np.float32)
    cfg, attn = _hf(q_lora_rank, interleave)
    want = _hf_forward(cfg, attn, x)
    layer = _copied(attn, _mla(q_lora_rank, interleave=interleave))
    got = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # Gradients of every weight through the chunked kernel's backward (v's head dim
    # unlike q/k's) against torch's autograd.
    cot = np.random.default_rng(1).normal(size=want.shape).astype(np.float32)
    grads = nnx.jit(nnx.grad(lambda m, x: (m(x) * cot).sum()))(layer, x)
    (torch.from_numpy(cot) * _hf_forward_grad(cfg, attn, x)).sum().backward()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(p.grad)
    want_grads = nnx.state(_copied(attn, _mla(q_lora_rank, interleave=interleave)), nnx.Param)
    for got_g, want_g in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-5)
    # Decoding: a 4-token prefill, then one token at a time, through the latent cache with
    # the up-projections absorbed, gives the full forward's outputs.
    cache = layer.init_cache(2, L, jnp.float32)
    step = nnx.jit(lambda m, x, cache, start: m.decode(x, cache, start))
    outs = []
    for start, end in [(0, 4)] + [(i, i + 1) for i in range(4, L)]:
        y, new = step(layer, x[:, start:end], cache, jnp.int32(start))
        # the layer reads the cache as it was; its new entries are the caller's to write
        assert [n.shape for n in new] == [(2, end - start, RKV), (2, end - start, ROPE)]
        cache = tuple(decode_cache.write(c, n, start) for c, n in zip(cache, new))
        outs.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(outs, 1), want, rtol=1e-5, atol=1e-5)
    # The cache holds the latent and the rotary key, nothing expanded per head.
    assert [c.shape for c in cache] == [(2, L, RKV), (2, L, ROPE)]


def test_cache_bytes_per_token_against_gqa():
    """The planner's fact, equal to the decoding cache's real size, against GQA at the
    same width; DeepSeek-V3's own shapes: 576 numbers per token and layer against 32768
    for its 128 heads of 128 as MHA (and 4096 as GQA with 16 kv heads)."""
    layer = _mla(12)
    cache = layer.init_cache(3, L, jnp.bfloat16)
    per_token = sum(c.nbytes for c in cache) // (3 * L)
    assert per_token == layer.mla.cache_bytes_per_token(2) == (RKV + ROPE) * 2
    assert mla_lib.gqa_cache_bytes_per_token(H, NOPE + ROPE, 2) == 2 * H * 12 * 2
    v3 = mla_lib.MlaSpec(512, 128, 64, 128, 1536)
    assert v3.cache_bytes_per_token(2) == 576 * 2
    assert mla_lib.gqa_cache_bytes_per_token(128, 128, 2) == 32768 * 2
    assert mla_lib.gqa_cache_bytes_per_token(16, 128, 2) / v3.cache_bytes_per_token(2) > 7
    assert mla_lib.MLA.cache_bytes_per_token(v3, 2) == 1152


def test_which_kernels_take_a_v_head_dim_unlike_qk():
    """Read from the kernels: the reference kernel, the chunked kernel (unrolled and looped)
    and splash take it; cuDNN and Pallas do not, and a config naming one is refused in one
    line, as is the context-parallel attention (flash accumulators of q's head dim)."""
    for seq_len in (256, 128 * 17):  # unrolled; looped past 16 chunks (another code path)
        assert mla_lib.takes_value_head_dim("chunked", seq_len)
        assert mla_lib.takes_value_head_dim("xla", seq_len)
    for name in ("cudnn", "pallas"):
        assert not mla_lib.takes_value_head_dim(name, 256), name

    def config(**model):
        m = {"attention": "chunked", "seq_len": 256, "mla": mla_lib.defaults(), **model}
        m["mla"] = {**m["mla"], "kv_lora_rank": 16}
        return ml_collections.ConfigDict({"model": m})

    mla_lib.check(config())
    mla_lib.check(config(attention="xla", seq_len=128 * 17))
    with pytest.raises(ConfigError, match=r"^model.attention='cudnn' is invalid: it cannot "
                       r"run MLA's v head dim \(unlike q/k's\) at model.seq_len=256; use "):
        mla_lib.check(config(attention="cudnn"))
    with pytest.raises(ConfigError, match="mesh.context=2 is invalid: MLA's v head dim"):
        mla_lib.check(config(), {"context": 2})
    # 'auto' takes only such kernels: not cuDNN on a GPU, at any length.
    for seq_len in (256, 128 * 17):
        assert mla_lib.resolve_kernel("auto", "bfloat16", "gpu", seq_len) == "chunked"
    assert mla_lib.resolve_kernel("auto", "bfloat16", "cpu", 256) == "chunked"
    long = config(seq_len=128 * 17, attention="auto")
    long.train = {"precision": "bfloat16"}
    mla_lib.check(long, platform="tpu")  # splash
    mla_lib.check(long, platform="gpu")  # chunked, looped


@pytest.mark.parametrize("kernel, seq_len", [("xla", 64), ("chunked", 256),
                                             ("chunked", 128 * 17)],
                         ids=["xla", "chunked", "chunked-looped"])
def test_the_kernels_that_take_mla_equal_float64_attention(kernel, seq_len):
    """Output and the q, k, v gradients with v's head dim (4) unlike q/k's (8), against
    the float64 reference (helpers.attention_f64), grouped heads included."""
    from helpers import attention_f64

    from jaxtrain.models.attention.kernels import KERNELS

    rng = np.random.default_rng(0)
    q, k = (rng.normal(size=(1, seq_len, g, 8)).astype(np.float32) for g in (4, 2))
    v = rng.normal(size=(1, seq_len, 2, 4)).astype(np.float32)
    cot = rng.normal(size=(1, seq_len, 4, 4)).astype(np.float32)

    def loss(q, k, v):
        return (KERNELS[kernel](q, k, v, None, rules=()) * cot).sum()

    out = KERNELS[kernel](q, k, v, None, rules=())
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want, want_grads = attention_f64(q, k, v, cotangent_BLHK=cot)
    np.testing.assert_allclose(out, want, atol=2e-5)
    for got, ref in zip(grads, want_grads):
        np.testing.assert_allclose(got, ref, atol=2e-4)


def test_mla_config_errors_name_the_key():
    bad = ml_collections.ConfigDict({"model": {
        "attention": "chunked", "seq_len": 256,
        "mla": {**mla_lib.defaults(), "kv_lora_rank": 16}}})
    bad.model.mla.qk_rope_head_dim = 3
    with pytest.raises(ConfigError, match="model.mla.qk_rope_head_dim=3 is invalid"):
        mla_lib.check(bad)
