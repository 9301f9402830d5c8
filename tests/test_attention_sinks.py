"""The attention-sinks part (models/families.py ATTENTION_PARTS 'sinks': a learned logit per
head joining every query's softmax, gpt-oss's `self_attn.sinks`): the xla kernel against
transformers' own gpt-oss attention function (eager_attention_forward), output and the
sinks' gradient, with and without a window; the kernels without the part refuse it in one
line; a family made of existing parts plus the sinks decodes through the kv cache as its
full forward (the part's parameter reaching the cached kernel too)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from jaxtrain.errors import ConfigError
from jaxtrain.models.attention import KERNELS, resolve_attention
from jaxtrain.models.attention.xla import xla_attention
from jaxtrain.models.families import FAMILIES, Family


def _transformers_attention(q_BLHK, k_BLGK, v_BLGK, sinks_H, window):
    """gpt-oss's eager attention in PyTorch (its own function, a stand-in module holding
    the sinks), on the unscaled q: (output [B, L, H, K], d<output, cotangent>/dsinks)."""
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    b, length, h, k = q_BLHK.shape
    g = k_BLGK.shape[2]
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.from_numpy(sinks_H))
    module.num_key_value_groups = h // g
    module.training = False
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    mask = torch.from_numpy(np.where(visible, 0.0, np.finfo(np.float32).min).astype(
        np.float32))[None, None]
    out, _ = eager_attention_forward(
        module, *(torch.from_numpy(x).transpose(1, 2) for x in (q_BLHK, k_BLGK, v_BLGK)),
        mask, scaling=k ** -0.5)
    cotangent = np.random.default_rng(3).normal(size=out.shape).astype(np.float32)
    (out * torch.from_numpy(cotangent)).sum().backward()
    return out.detach().numpy(), cotangent, module.sinks.grad.numpy()


@pytest.mark.parametrize("window", [None, 5])
def test_the_xla_kernel_is_transformers_gpt_oss_attention(window):
    rng = np.random.default_rng(0)
    b, length, h, g, k = 2, 12, 4, 2, 8
    q, kk, v = (rng.normal(size=(b, length, n, k)).astype(np.float32) for n in (h, g, g))
    sinks = rng.normal(size=(h,)).astype(np.float32) * 2.0
    want, cotangent, want_grad = _transformers_attention(q, kk, v, sinks, window)

    def ours(sinks_H):
        return xla_attention(jnp.asarray(q) * k ** -0.5, jnp.asarray(kk), jnp.asarray(v),
                             window, sinks=sinks_H)

    out, pull = jax.vjp(ours, jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6)
    (grad,) = pull(jnp.asarray(cotangent))
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
    # The sinks show: without them the output differs.
    assert np.abs(np.asarray(xla_attention(jnp.asarray(q) * k ** -0.5, jnp.asarray(kk),
                                           jnp.asarray(v), window)) - want).max() > 1e-2


def _family(monkeypatch):
    """A family of existing parts (Llama's with the sinks): one registry entry, no other
    file."""
    monkeypatch.setitem(FAMILIES, "sinks_test", Family(
        "sinks_test", "Llama's parts with attention sinks", norm="rms", bias=False,
        rope=True, tied_embeddings=False, mlp="swiglu", attention=("sinks",)))


def test_kernels_without_the_sinks_refuse_them_in_one_line(monkeypatch):
    from jaxtrain.config import validate

    for kernel in KERNELS.values():
        precision = "float32" if kernel.float32 else "bfloat16"
        problem = kernel.problem(precision, kernel.platforms[0], 256, 0, False, 0.0, ("sinks",))
        if kernel.sinks:
            assert problem is None, kernel.name
        else:
            assert f"the {kernel.name} kernel cannot run the family's attention part 'sinks'" \
                in problem and "\n" not in problem
    assert resolve_attention("auto", "bfloat16", "gpu", 256, 0, False, 0.0, ("sinks",)) == "xla"
    _family(monkeypatch)
    cfg = small_config("sinks_test", **{"model.attention": "chunked"})
    with pytest.raises(ConfigError, match=r"model.attention='chunked' is invalid: the chunked "
                       r"kernel cannot run the family's attention part 'sinks'; use xla"):
        validate(cfg, 1, "cpu")
    with pytest.raises(ConfigError, match=r"model.family='sinks_test' is invalid: its "
                       r"attention parts \('sinks',\) run inside the kernel"):
        validate(small_config("sinks_test", **{"mesh.context": 2}), 2, "cpu")


def test_a_family_with_sinks_decodes_as_its_full_forward(monkeypatch, devices):
    from helpers import assert_cached_decoding_matches_full_forward

    from jaxtrain.train.setup import build

    _family(monkeypatch)
    cfg = small_config("sinks_test", **{"train.global_batch": 1, "model.init_std": 0.3,
                                        "model.sliding_window": 6})
    setup = build(cfg, devices[:1])
    assert setup.spec.attention == "xla"  # 'auto' picks the kernel with the part
    params = setup.init_state().params
    assert params["blocks"]["attn"]["sinks"].shape == (2, 8)  # [layers, heads]
    params["blocks"]["attn"]["sinks"] = jnp.linspace(-2.0, 2.0, 16).reshape(2, 8)
    assert_cached_decoding_matches_full_forward(setup, params)
