"""The hand-written backward passes (norms, GELU, weight matmuls, fused head + loss, the
sharded embedding gradient) against
plain autodiff, and rotary embeddings against an independent complex-number form."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain.models.head_loss import head_cross_entropy, token_logprobs
from jaxtrain.models.layers import _norm, _weight_matmul, gelu, rope


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def _reference_norm(x, scale, bias, rms: bool, eps: float):
    xf = x.astype(jnp.float32)
    if not rms:
        xf = xf - xf.mean(-1, keepdims=True)
    xf = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps)
    xf = xf * scale
    if bias is not None:
        xf = xf + bias
    return xf.astype(x.dtype)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norm_backward_equals_autodiff(rms, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    x = (3 * jax.random.normal(keys[0], (2, 8, 32)) + 1).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(keys[1], (32,))
    bias = None if rms else 0.1 * jax.random.normal(keys[2], (32,))
    weights = jax.random.normal(keys[3], (2, 8, 32))
    args = (x, scale) if rms else (x, scale, bias)

    def loss(norm, *args):
        return (norm(*args[:2], None if rms else args[2], rms, 1e-5).astype(jnp.float32)
                * weights).sum()

    got = jax.jit(jax.value_and_grad(lambda *a: loss(_norm, *a), argnums=range(len(args))))(*args)
    want = jax.value_and_grad(lambda *a: loss(_reference_norm, *a), argnums=range(len(args)))(*args)
    assert _rel(got[0], want[0]) < 1e-6
    for g, w in zip(got[1], want[1]):
        assert g.dtype == w.dtype
        assert _rel(g, w) < (1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_backward_equals_autodiff(dtype):
    keys = jax.random.split(jax.random.key(2), 2)
    u = (3 * jax.random.normal(keys[0], (4, 64))).astype(dtype)  # tails and the bend
    weights = jax.random.normal(keys[1], (4, 64))

    def loss(fn, u):
        return (fn(u).astype(jnp.float32) * weights).sum()

    got = jax.jit(jax.value_and_grad(lambda u: loss(gelu, u)))(u)
    want = jax.jit(jax.value_and_grad(
        lambda u: loss(lambda v: jax.nn.gelu(v, approximate=True), u)))(u)
    assert _rel(got[0], want[0]) < 1e-6
    assert got[1].dtype == want[1].dtype
    # bfloat16: autodiff rounds each of its intermediate steps to bfloat16, the closed form
    # rounds once.
    assert _rel(got[1], want[1]) < (1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_head_loss_equals_plain_cross_entropy(vocab_major):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (2, 16, 8))
    head_DV = jax.random.normal(keys[1], (8, 40))
    targets = jax.random.randint(keys[2], (2, 16), 0, 40)
    head = head_DV.T if vocab_major else head_DV

    def plain(x, head):
        logits = x @ (head.T if vocab_major else head)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    got = jax.jit(jax.value_and_grad(
        lambda x, h: head_cross_entropy(x, h, targets, vocab_major=vocab_major),
        argnums=(0, 1)))(x, head)
    want = jax.value_and_grad(plain, argnums=(0, 1))(x, head)
    assert _rel(got[0], want[0]) < 1e-6
    for g, w in zip(got[1], want[1]):
        assert g.shape == w.shape
        assert _rel(g, w) < 1e-5


@pytest.mark.parametrize("vocab_major", [False, True])
def test_token_logprobs_and_their_gradients_equal_float64_numpy(vocab_major):
    """models/head_loss.token_logprobs (each target's log-probability, chunked: what DPO
    sums per sequence) against log-softmax written out in float64 numpy, gradients of a
    weighted sum included; 600 positions in chunks of 300 (head_loss.chunk_size), so the
    scan takes two steps."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 600, 8)).astype(np.float32)
    head_DV = (rng.normal(size=(8, 40)) * 0.5).astype(np.float32)
    targets = rng.integers(0, 40, (2, 600))
    weights = rng.normal(size=(2, 600))
    head = head_DV.T if vocab_major else head_DV

    def weighted(x, h):
        lp = token_logprobs(x, h, jnp.asarray(targets), vocab_major=vocab_major)
        return (lp * weights).sum(), lp

    (_, got), grads = jax.jit(jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True))(
        jnp.asarray(x), jnp.asarray(head))
    logits = x.astype(np.float64) @ head_DV.astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(got, np.take_along_axis(logp, targets[..., None], -1)[..., 0],
                               atol=2e-6)
    dlogits = (np.eye(40)[targets] - np.exp(logp)) * weights[..., None]
    dhead = np.einsum("bld,blv->dv", x, dlogits)
    np.testing.assert_allclose(grads[0], np.einsum("blv,dv->bld", dlogits, head_DV), atol=2e-5)
    np.testing.assert_allclose(grads[1], dhead.T if vocab_major else dhead, atol=2e-5)


@pytest.mark.parametrize("equation,x_shape,w_shape", [
    ("bld,df->blf", (2, 5, 8), (8, 12)),           # an MLP projection
    ("bld,dhk->blhk", (2, 5, 8), (8, 3, 4)),       # q/k/v: one input axis, two output axes
    ("blhk,hkd->bld", (2, 5, 3, 4), (3, 4, 8)),    # the attention output: two input axes
])
def test_weight_matmul_backward_equals_autodiff(equation, x_shape, w_shape):
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    out_shape = jnp.einsum(equation, x, w).shape
    g = jax.random.normal(kg, out_shape)
    np.testing.assert_allclose(_weight_matmul(x, w, equation), jnp.einsum(equation, x, w),
                               rtol=1e-5, atol=1e-5)
    ours = jax.vjp(lambda x, w: _weight_matmul(x, w, equation), x, w)[1](g)
    plain = jax.vjp(lambda x, w: jnp.einsum(equation, x, w), x, w)[1](g)
    for got, want in zip(ours, plain):
        assert got.shape == want.shape
        assert _rel(got, want) < 1e-5


def _rope_by_hand(x, positions, theta):
    """Rotary embedding as complex multiplication: pairs (i, i + K/2) of each head are the
    real and imaginary parts, rotated by position × theta^(-2i/K)."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(
        1j * np.asarray(positions, np.float64)[None, :, None, None] * freq)
    return np.concatenate([z.real, z.imag], axis=-1)


def test_rope_equals_complex_rotation_at_shifted_positions():
    x = jax.random.normal(jax.random.key(2), (2, 6, 3, 8))
    for positions in (np.arange(6), np.arange(6) + 1000, np.array([0, 5, 9, 100, 101, 4096])):
        np.testing.assert_allclose(rope(x, 10000.0, jnp.asarray(positions)),
                                   _rope_by_hand(x, positions, 10000.0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rope(x, 500.0), _rope_by_hand(x, np.arange(6), 500.0),
                               rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_positions():
    kq, kk = jax.random.split(jax.random.key(3))
    q, k = jax.random.normal(kq, (1, 5, 2, 16)), jax.random.normal(kk, (1, 5, 2, 16))
    positions = jnp.arange(5)
    scores = jnp.einsum("bqhk,bmhk->bhqm", rope(q, 1e4, positions), rope(k, 1e4, positions))
    for shift in (7, 300):
        shifted = jnp.einsum("bqhk,bmhk->bhqm", rope(q, 1e4, positions + shift),
                             rope(k, 1e4, positions + shift))
        np.testing.assert_allclose(shifted, scores, rtol=1e-3, atol=1e-3)


EMBED_LAYOUTS = {
    # ZeRO over fsdp, vocab over tensor: the ids all-gathered, the gradients all-to-all'd.
    "fsdp=4 tensor=2": ({"fsdp": 4, "tensor": 2}, False),
    # Sequence parallelism: the tokens are split over tensor, the vocab axis, too.
    "data=2 fsdp=2 tensor=2 sp": ({"data": 2, "fsdp": 2, "tensor": 2}, True),
    # ZeRO over fsdp × context: the tokens' positions split over context.
    "fsdp=2 context=2 tensor=2": ({"fsdp": 2, "context": 2, "tensor": 2}, False),
    # No ZeRO axis: the scatter's psum over data alone.
    "data=4 tensor=2": ({"data": 4, "tensor": 2}, False),
}


@pytest.mark.parametrize("layout", EMBED_LAYOUTS)
def test_embedding_gradient_scattered_into_its_shard_equals_the_lookups(layout, devices,
                                                                        monkeypatch):
    """models/embedding.py forms the table's gradient inside a shard_map, in the table's own
    sharding (not by its autodiff fallback): it must be the lookup's gradient, every token's
    output gradient added into its row, on every layout it takes."""
    from jax.sharding import NamedSharding

    from jaxtrain.config import MESH_AXES
    from jaxtrain.mesh import DEFAULT_RULES, active_rules, logical_to_spec, make_mesh
    from jaxtrain.models import embedding
    from jaxtrain.models.embedding import TABLE, TOKENS, embed

    traced = []
    local_grad = embedding._local_grad
    monkeypatch.setattr(embedding, "_local_grad", lambda *a, **kw: traced.append(1) or
                        local_grad(*a, **kw))

    axes, sp = EMBED_LAYOUTS[layout]
    sizes = {a: axes.get(a, 1) for a in MESH_AXES}
    mesh = make_mesh(sizes, devices)
    rules = active_rules(DEFAULT_RULES, sp, context=sizes["context"] > 1)
    rng = np.random.default_rng(0)
    vocab, d, b, length = 64, 16, 8, 8
    table = rng.normal(size=(vocab, d)).astype(np.float32)
    tokens = rng.integers(0, vocab, (b, length)).astype(np.int32)
    tokens[0, :4] = 3  # repeated ids: their gradients add
    dout = rng.normal(size=(b, length, d)).astype(np.float32)
    want = np.zeros_like(table)
    np.add.at(want, tokens, dout)

    def loss(table, tokens, dout):
        return (embed(table, tokens, jnp.float32, rules) * dout).sum()

    with jax.set_mesh(mesh):
        put = lambda x, names: jax.device_put(  # noqa: E731
            x, NamedSharding(mesh, logical_to_spec(names, rules)))
        args = (put(table, TABLE), put(tokens, TOKENS), put(dout, (*TOKENS, None)))
        compiled = jax.jit(jax.value_and_grad(loss)).lower(*args).compile()
        value, grad = compiled(*args)
    assert traced, "the autodiff fallback ran, not the sharded scatter"
    assert "all-to-all" in compiled.as_text() or not {"fsdp", "context"} & set(axes)
    np.testing.assert_allclose(value, (table[tokens] * dout).sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want, atol=1e-5)
    assert grad.sharding.spec == logical_to_spec(TABLE, rules)
