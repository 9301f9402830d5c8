"""Document masks in every attention kernel (models/attention KERNELS): a packed row's
outputs and gradients equal a plain causal float64 reference in which a query sees only the
keys of its own document (tests/helpers.py attention_f64): each document as if run alone.
splash and pallas run in Pallas's interpreter; cuDNN has no CPU form, so its packed layout
(the offsets and lengths it is given) is checked here; the kernel runs only on a GPU
(scripts/accelerator/attention_check.py, on unpacked rows: a packed cuDNN row is not checked
there yet)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import attention_f64

from jaxtrain.models.attention import KERNELS
from jaxtrain.models.attention.chunked import chunked_attention
from jaxtrain.models.attention.cudnn import max_segments, packed_layout


def segments(length: int, lengths_per_row) -> np.ndarray:
    """Rows of documents of the given lengths (ids 1, 2, ...), padding (0) after them."""
    out = np.zeros((len(lengths_per_row), length), np.int32)
    for row, lengths in zip(out, lengths_per_row):
        at = 0
        for k, n in enumerate(lengths, start=1):
            row[at:at + n] = k
            at += n
    return out


def inputs(b, length, heads, groups, head_dim=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, length, heads, head_dim)) * head_dim ** -0.5
    k = jax.random.normal(keys[1], (b, length, groups, head_dim))
    v = jax.random.normal(keys[2], (b, length, groups, head_dim))
    return q, k, v, jax.random.normal(keys[3], (b, length, heads, head_dim))


def out_and_grads(fn, q, k, v, cotangent):
    def f(q, k, v):
        return fn(q, k, v)

    def loss(q, k, v):
        return jnp.vdot(f(q, k, v), cotangent)

    return jax.jit(f)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


# Kernel -> (length, documents per row, a keyword for a small block). Documents cross the
# chunked kernel's 16-row chunks and the Pallas kernels' blocks; a 2-token document, one
# longer than a block, and padding at a row's end.
CASES = {
    "xla": (32, [[5, 2, 20], [32]], {}),
    "chunked": (64, [[5, 2, 30, 20], [17, 40]], {"block": 16}),
    "pallas": (64, [[5, 2, 30, 20], [17, 40]], {}),
    "splash": (128, [[5, 2, 70, 40], [17, 100]], {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_masks_documents(name):
    length, docs, extra = CASES[name]
    q, k, v, cotangent = inputs(len(docs), length, 4, 2)
    ids = jnp.asarray(segments(length, docs))
    kernel = KERNELS[name]
    fn = (functools.partial(chunked_attention, **extra) if extra else kernel.fn)
    got, got_grads = out_and_grads(lambda q, k, v: fn(q, k, v, None, segments_BL=ids),
                                   q, k, v, cotangent)
    want, want_grads = attention_f64(q, k, v, None, ids, cotangent)
    tol = 2e-2 if name == "splash" else 2e-5  # splash: bf16-ish accumulation in interpret
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=tol, rtol=tol)


def test_every_kernel_is_covered():
    """A new kernel in the registry gets a document-mask case here (cuDNN: its layout)."""
    assert set(KERNELS) == {*CASES, "cudnn"}
    assert all(k.segments for k in KERNELS.values())


def test_cudnn_packed_layout():
    ids = jnp.asarray(segments(16, [[5, 2, 7], [16], [2, 2, 2, 2, 2, 2, 2, 2]]))
    offsets, lengths = packed_layout(ids, max_segments(16))
    assert offsets.shape == (3, 10) and lengths.shape == (3, 9)
    np.testing.assert_array_equal(lengths[0], [5, 2, 7, 2] + [-1] * 5)
    np.testing.assert_array_equal(offsets[0], [0, 5, 7, 14] + [-1] * 6)
    np.testing.assert_array_equal(lengths[1], [16] + [-1] * 8)
    np.testing.assert_array_equal(lengths[2], [2] * 8 + [-1])
    np.testing.assert_array_equal(offsets[2], list(range(0, 16, 2)) + [-1, -1])
