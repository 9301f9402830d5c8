"""Attention implementations match a float64 numpy reference (tests/helpers.py
attention_f64) in outputs and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import attention_f64, attention_inputs, relative_error

from jaxtrain.models.attention import KERNELS, resolve_attention


def _assert_matches(kernel, q, k, v, cotangent, window=None, segments=None, tol=1e-5):
    """kernel(q, k, v) equals the float64 reference in outputs and gradients, to tol
    relative to the largest entry."""
    fn = jax.jit(kernel)
    got = fn(q, k, v)
    grads = jax.grad(lambda q, k, v: jnp.vdot(fn(q, k, v), cotangent), argnums=(0, 1, 2))(
        q, k, v)
    want, want_grads = attention_f64(q, k, v, window, segments, cotangent)
    assert relative_error(got, want) < tol
    for g, w in zip(grads, want_grads):
        assert relative_error(g, w) < tol


SHAPES = [
    (2, 256, 4, 4, 16),   # multi-head, two query chunks
    (2, 300, 8, 2, 16),   # grouped-query, a length that does not divide the chunk size
    (1, 64, 4, 1, 8),     # multi-query (one kv head), a single chunk
    (1, 96, 4, 2, 16),    # grouped-query at a length of 3 blocks of 32
]


# Pallas runs interpreted on CPU: it gets the short shapes only.
@pytest.mark.parametrize("impl,shape", [(i, s) for i in ("xla", "chunked") for s in SHAPES]
                         + [("pallas", s) for s in SHAPES if s[1] <= 128])
def test_implementations_match_the_reference_in_outputs_and_gradients(impl, shape):
    _assert_matches(KERNELS[impl], *attention_inputs(*shape))


# Windows shorter than, equal to and longer than the chunked kernel's 128-row blocks.
@pytest.mark.parametrize("shape,window", [((2, 300, 8, 2, 16), 50),
                                          ((1, 256, 4, 4, 16), 128),
                                          ((1, 300, 4, 1, 8), 200)])
def test_chunked_matches_the_reference_with_a_sliding_window(shape, window):
    _assert_matches(lambda q, k, v: KERNELS["chunked"](q, k, v, window), *attention_inputs(*shape),
                    window=window)


# The looped form (more than UNROLL_MAX_CHUNKS query chunks): 16-row chunks make these
# lengths 24-34 chunks, with key blocks of 64, 32 and 16 positions.
@pytest.mark.parametrize("shape,window,documents", [((2, 512, 4, 2, 16), None, False),
                                                    ((1, 544, 4, 1, 8), 50, False),
                                                    ((1, 384, 8, 8, 8), 100, True)])
def test_looped_chunked_kernel_matches_the_reference(shape, window, documents):
    from jaxtrain.models.attention.chunked import chunked_attention, looped

    assert looped(shape[1], 16)
    segments = None
    if documents:  # documents of 100, 3, 200 and the rest of the row
        ids = np.repeat(np.arange(1, 5), [100, 3, 200, shape[1] - 303])
        segments = jnp.asarray(np.tile(ids, (shape[0], 1)), jnp.int32)
    _assert_matches(lambda q, k, v: chunked_attention(q, k, v, window, segments, block=16),
                    *attention_inputs(*shape), window=window, segments=segments)


# In bfloat16 the backward's P and dS meet their matmuls in bfloat16 too (as flash kernels
# do; float32 accumulation), a path float32 inputs never take. Gradients against the float64
# reference: max relative error 0.0045 for each kernel (measured 2026-12-02, then against
# float32 xla), as with float32 P and dS (bf16's own rounding step is 0.0039); a wrong
# transpose would be O(1).
@pytest.mark.parametrize("name,shape", [("xla", (1, 256, 8, 2, 16)),
                                        ("chunked", (1, 256, 8, 2, 16)),
                                        ("looped", (1, 512, 4, 2, 16))])
def test_bfloat16_gradients_track_float32(name, shape):
    from jaxtrain.models.attention.chunked import chunked_attention

    kernel = (functools.partial(chunked_attention, block=16) if name == "looped"
              else KERNELS[name])
    q, k, v, cotangent = attention_inputs(*shape)

    def loss(q, k, v):
        return jnp.vdot(kernel(q, k, v).astype(jnp.float32), cotangent)

    args = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    _, want_grads = attention_f64(q, k, v, cotangent_BLHK=cotangent)
    for got, want in zip(grads, want_grads):
        assert got.dtype == jnp.bfloat16
        assert relative_error(got.astype(jnp.float32), want) < 0.02


@pytest.mark.parametrize("name", ["xla", "chunked"])
def test_sliding_window_sees_exactly_the_last_w_keys(name):
    q, k, v, _ = attention_inputs(1, 200, 4, 2, 16)
    window, pos = 40, 150
    out = KERNELS[name](q, k, v, window)
    # Changing keys/values outside (pos - window, pos] leaves position pos alone ...
    outside = jnp.zeros(200, bool).at[:pos - window + 1].set(True).at[pos + 1:].set(True)
    k2 = jnp.where(outside[None, :, None, None], k * 3.0, k)
    v2 = jnp.where(outside[None, :, None, None], -v, v)
    np.testing.assert_allclose(KERNELS[name](q, k2, v2, window)[:, pos], out[:, pos],
                               atol=1e-6)
    # ... while its oldest key inside the window matters, and a window as long as the
    # sequence is plain causal attention.
    v3 = v.at[:, pos - window + 1].add(1.0)
    assert not np.allclose(KERNELS[name](q, k, v3, window)[:, pos], out[:, pos])
    np.testing.assert_allclose(KERNELS[name](q, k, v, 200), KERNELS[name](q, k, v),
                               atol=1e-6)


def test_attention_is_causal():
    q, k, v, _ = attention_inputs(1, 256, 4, 2, 16)
    for name in ("xla", "chunked", "pallas"):
        before = KERNELS[name](q, k, v)[:, :100]
        v_later = v.at[:, 100:].set(0.0)  # changing later positions changes nothing earlier
        np.testing.assert_allclose(KERNELS[name](q, k, v_later)[:, :100], before, atol=1e-6)


def test_auto_picks_per_backend():
    assert resolve_attention("auto", "bfloat16", "gpu") == "cudnn"
    assert resolve_attention("auto", "float32", "gpu") == "chunked"
    assert resolve_attention("auto", "float32", "cpu") == "chunked"
    assert resolve_attention("xla", "bfloat16", "gpu") == "xla"
    assert resolve_attention("auto", "bfloat16", "tpu", seq_len=2048) == "splash"
    assert resolve_attention("auto", "bfloat16", "tpu", seq_len=100) == "chunked"
    assert resolve_attention("pallas", "bfloat16", "tpu") == "splash"
    assert resolve_attention("pallas", "bfloat16", "gpu") == "pallas"


@functools.cache
def _llama_loss_and_grads(remat: str):
    """Loss and gradients of the small Llama under a remat policy (cached: 'none' is every
    policy's reference)."""
    from conftest import small_config

    from jaxtrain.data.batches import make_batches
    from jaxtrain.train.setup import build
    from jaxtrain.train.step import loss_fn

    cfg = small_config("llama", **{"model.remat": remat})
    setup = build(cfg, jax.devices()[:1])
    params = setup.init_state().params
    tokens = next(make_batches(cfg).train_iter(0))
    with jax.set_mesh(setup.mesh):
        return jax.jit(jax.value_and_grad(
            lambda p, t: loss_fn(p, setup.graphdef, t)))(params, tokens)


@pytest.mark.parametrize("remat", ["full", "save_dots", "save_dots_except_mlp",
                                   "save_attention_out"])
def test_remat_policies_give_the_loss_and_grads_of_none(remat, devices):
    (loss, grads), (loss_r, grads_r) = _llama_loss_and_grads("none"), _llama_loss_and_grads(remat)
    assert abs(float(loss_r) - float(loss)) < 1e-6
    for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
        assert relative_error(a, b) < 1e-5


def test_offload_dots_is_refused_on_cpu(devices):
    from conftest import small_config

    from jaxtrain.config import ConfigError
    from jaxtrain.train.setup import build

    with pytest.raises(ConfigError, match="offload_dots' is invalid: offloading to pinned host"):
        build(small_config(**{"model.remat": "offload_dots"}), devices[:1])
