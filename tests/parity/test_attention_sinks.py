"""The attention-sinks part (models/families.py ATTENTION_PARTS 'sinks': a learned logit per
head joining every query's softmax, gpt-oss's `self_attn.sinks`): the xla and chunked
kernels against transformers' own gpt-oss attention function (eager_attention_forward),
output and the gradients in q, k, v and the sinks, with and without a window; the kernels without the part refuse it in one
line; a family made of existing parts plus the sinks decodes through the kv cache as its
full forward (the part's parameter reaching the cached kernel too)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from jaxtrain.errors import ConfigError
from jaxtrain.models.attention import KERNELS, resolve_attention
from jaxtrain.models.attention.chunked import chunked_attention, looped
from jaxtrain.models.attention.xla import xla_attention
from jaxtrain.models.families import FAMILIES, Family


def _transformers_attention(q_BLHK, k_BLGK, v_BLGK, sinks_H, window):
    """gpt-oss's eager attention in PyTorch (its own function, a stand-in module holding
    the sinks), on the unscaled q: (output [B, L, H, K], the cotangent, and the gradients
    of <output, cotangent> in q, k, v and the sinks)."""
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
    inputs = [torch.from_numpy(x).requires_grad_() for x in (q_BLHK, k_BLGK, v_BLGK)]
    out, _ = eager_attention_forward(module, *(x.transpose(1, 2) for x in inputs), mask,
                                     scaling=k ** -0.5)
    cotangent = np.random.default_rng(3).normal(size=out.shape).astype(np.float32)
    (out * torch.from_numpy(cotangent)).sum().backward()
    grads = [x.grad.numpy() for x in inputs] + [module.sinks.grad.numpy()]
    return out.detach().numpy(), cotangent, grads


# The kernels with the part: the reference, and chunked both unrolled (3 query chunks of 4)
# and looped (40 positions in chunks of 2: more than UNROLL_MAX_CHUNKS, so it loops).
SINK_KERNELS = {"xla": (xla_attention, 12),
                "chunked": (functools.partial(chunked_attention, block=4), 12),
                "looped": (functools.partial(chunked_attention, block=2), 40)}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("name", SINK_KERNELS)
def test_each_kernel_with_sinks_is_transformers_gpt_oss_attention(name, window):
    """Output, and the gradients in q, k, v and the sinks (the chunked kernels' backward
    recomputes its probabilities from the logsumexp with the sink in: scaffold.with_sinks)."""
    kernel, length = SINK_KERNELS[name]
    if name == "looped":
        assert looped(length, 2)
    rng = np.random.default_rng(0)
    b, h, g, k = 2, 4, 2, 8
    q, kk, v = (rng.normal(size=(b, length, n, k)).astype(np.float32) for n in (h, g, g))
    sinks = rng.normal(size=(h,)).astype(np.float32) * 2.0
    want, cotangent, want_grads = _transformers_attention(q, kk, v, sinks, window)

    def ours(q_BLHK, k_BLGK, v_BLGK, sinks_H):
        return kernel(q_BLHK * k ** -0.5, k_BLGK, v_BLGK, window, sinks=sinks_H)

    out, pull = jax.vjp(ours, *map(jnp.asarray, (q, kk, v, sinks)))
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6)
    for got, wanted in zip(pull(jnp.asarray(cotangent)), want_grads):
        np.testing.assert_allclose(np.asarray(got), wanted, rtol=1e-5, atol=1e-5)
    # The sinks show: without them the output differs.
    assert np.abs(np.asarray(kernel(jnp.asarray(q) * k ** -0.5, jnp.asarray(kk),
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
    # cuDNN cannot: auto falls back to chunked, which can (xla only for the soft-cap).
    assert resolve_attention("auto", "bfloat16", "gpu", 256, 0, False, 0.0, ("sinks",)) == \
        "chunked"
    assert resolve_attention("auto", "bfloat16", "gpu", 256, 0, False, 30.0, ("sinks",)) == \
        "xla"
    _family(monkeypatch)
    cfg = small_config("sinks_test", **{"model.attention": "pallas"})
    with pytest.raises(ConfigError, match=r"model.attention='pallas' is invalid: the pallas "
                       r"kernel cannot run the family's attention part 'sinks'; use chunked, "
                       r"xla"):
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
    # 'auto' picks chunked, which runs the part: its full forward against the cached decode
    assert setup.spec.attention == "chunked"
    params = setup.init_state().params
    assert params["blocks"]["attn"]["sinks"].shape == (2, 8)  # [layers, heads]
    params["blocks"]["attn"]["sinks"] = jnp.linspace(-2.0, 2.0, 16).reshape(2, 8)
    assert_cached_decoding_matches_full_forward(setup, params)
