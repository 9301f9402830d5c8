"""The gated delta rule's chunked (training, prefill) and recurrent (decoding) forms
(models/linear_attention/delta_rule.py) against a float64 numpy loop over the recurrence
itself: outputs and final states for several lengths (some not a multiple of the chunk),
several chunk sizes and a given initial state, and gradients of every input against
central differences of that float64 loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models.linear_attention import delta_rule

TOLERANCE = 2e-5  # float32 against float64, |Δ| of outputs ~1


def reference(q, k, v, g, beta, state=None):
    """The recurrence token by token in float64: (o [B, L, H, V], state [B, H, K, V])."""
    b, length, h, kd = q.shape
    s = np.zeros((b, h, kd, v.shape[-1])) if state is None else state.astype(np.float64)
    o = np.zeros(v.shape, np.float64)
    for t in range(length):
        s = s * np.exp(g[:, t])[..., None, None]
        read = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        s = s + k[:, t][..., :, None] * ((v[:, t] - read) * beta[:, t][..., None])[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return o, s


def inputs(seed: int, b=2, length=13, h=2, kd=4, vd=6):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, b, length, h, kd))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(kd)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(b, length, h, vd))
    g = -np.log1p(np.exp(rng.normal(size=(b, length, h))))  # −softplus: ≤ 0
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, length, h))))
    return q, k, v, g, beta


def _f32(*xs):
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


@pytest.mark.parametrize("length", [1, 5, 8, 13, 19])
@pytest.mark.parametrize("chunk", [4, 8])
def test_chunked_equals_reference(length, chunk):
    args = inputs(length, length=length)
    want_o, want_s = reference(*args)
    o, s = delta_rule.chunked(*_f32(*args), chunk=chunk)
    np.testing.assert_allclose(np.asarray(o), want_o, atol=TOLERANCE)
    np.testing.assert_allclose(np.asarray(s), want_s, atol=TOLERANCE)


@pytest.mark.parametrize("length", [1, 6])
def test_recurrent_equals_reference(length):
    args = inputs(100 + length, length=length)
    state = np.random.default_rng(1).normal(size=(2, 2, 4, 6))
    want_o, want_s = reference(*args, state=state)
    o, s = delta_rule.recurrent(*_f32(*args), jnp.asarray(state, jnp.float32))
    np.testing.assert_allclose(np.asarray(o), want_o, atol=TOLERANCE)
    np.testing.assert_allclose(np.asarray(s), want_s, atol=TOLERANCE)


def test_chunked_from_a_state_then_recurrent_continues():
    """Prefill (chunked, from a given state) then a decode step (recurrent) equals the
    reference over the whole sequence: the cached state is the one the recurrence has."""
    args = inputs(7, length=11)
    state = np.random.default_rng(2).normal(size=(2, 2, 4, 6))
    want_o, want_s = reference(*args, state=state)
    head = [x[:, :10] for x in args]
    tail = [x[:, 10:] for x in args]
    o, s = delta_rule.chunked(*_f32(*head), chunk=4, state_BHKV=jnp.asarray(state, jnp.float32))
    o2, s2 = delta_rule.recurrent(*_f32(*tail), s)
    np.testing.assert_allclose(np.concatenate([o, o2], 1), want_o, atol=TOLERANCE)
    np.testing.assert_allclose(np.asarray(s2), want_s, atol=TOLERANCE)


def _numeric_grads(args, weight_o, weight_s, eps=1e-6):
    """Central differences of sum(o·w_o) + sum(S·w_s) of the float64 loop, every input."""
    def loss(xs):
        o, s = reference(*xs)
        return (o * weight_o).sum() + (s * weight_s).sum()

    grads = []
    for i, x in enumerate(args):
        grad = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            for sign in (1, -1):
                xs = [a.copy() for a in args]
                xs[i][idx] += sign * eps
                grad[idx] += sign * loss(xs) / (2 * eps)
        grads.append(grad)
    return grads


@pytest.mark.parametrize("form", ["chunked_3", "chunked_4", "recurrent"])
def test_gradients_equal_reference(form):
    args = inputs(3, b=1, length=7, h=2, kd=3, vd=4)
    rng = np.random.default_rng(4)
    weight_o, weight_s = rng.normal(size=args[2].shape), rng.normal(size=(1, 2, 3, 4))
    want = _numeric_grads(args, weight_o, weight_s)

    def loss(*xs):
        if form == "recurrent":
            o, s = delta_rule.recurrent(*xs, jnp.zeros((1, 2, 3, 4)))
        else:
            o, s = delta_rule.chunked(*xs, chunk=int(form.split("_")[1]))
        return (o * weight_o).sum() + (s * weight_s).sum()

    got = jax.grad(loss, argnums=tuple(range(5)))(*_f32(*args))
    for name, g, w in zip("q k v g beta".split(), got, want):
        np.testing.assert_allclose(np.asarray(g), w, atol=1e-4, rtol=1e-4, err_msg=name)


# -- the layer in a model: meshes, remat, the refusals -------------------------------------

HYBRID = {"model.num_layers": 4, "model.num_heads": 4, "model.num_kv_heads": 2,
          "model.head_dim": 16, "model.attention": "xla", "model.partial_rotary_factor": 0.5,
          "model.layer_types": "linear_attention,linear_attention,linear_attention,full",
          "model.linear_attention.num_key_heads": 2,
          "model.linear_attention.num_value_heads": 4,
          "model.linear_attention.chunk_size": 8}


def _hybrid(**overrides):
    from conftest import small_config

    return small_config("qwen3_5_text", **{**HYBRID, **overrides})


@pytest.fixture(scope="module")
def one_device(devices):
    from helpers import train_steps

    return train_steps(_hybrid(), devices[:1])


@pytest.mark.parametrize("overrides", [
    pytest.param({"mesh.fsdp": 4}, marks=pytest.mark.slow),
    {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},  # tensor: over the linear heads
    pytest.param({"model.remat": "full"}, marks=pytest.mark.slow),
], ids=["fsdp4", "dp2_fsdp2_tp2", "remat_full"])
def test_mesh_and_remat_match_one_device(overrides, one_device, devices):
    from helpers import assert_params_close, train_steps

    ref_losses, ref_params, _ = one_device
    count = int(np.prod([v for k, v in overrides.items() if k.startswith("mesh.")]))
    losses, params, _ = train_steps(_hybrid(**overrides), devices[:count])
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0], "the steps must actually train"
    assert_params_close(params, ref_params, rtol=1e-5)


@pytest.mark.parametrize("overrides,key", [
    ({"mesh.context": 2}, "mesh.context=2"),
    ({"mesh.pipeline": 2}, "mesh.pipeline=2"),
    ({"model.moe.num_experts": 4}, "model.moe.num_experts"),
    ({"model.linear_attention.num_value_heads": 3}, "num_value_heads"),
    ({"data.packing": "documents"}, "data.packing"),
    ({"model.lora.rank": 4}, "model.lora.rank"),
])
def test_what_linear_layers_cannot_run_is_refused_in_one_line(overrides, key):
    from jaxtrain.config import validate
    from jaxtrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(_hybrid(**overrides), overrides.get("mesh.context", 1)
                 * overrides.get("mesh.pipeline", 1), "cpu")
    assert key in str(e.value) and "\n" not in str(e.value)


def test_planner_facts_are_the_model_s():
    """The planner's per-layer facts (LinearSpec): the projections' weights are the
    layer's w_*, a slot's state bytes are init_cache's linear part (whatever its length),
    and the delta rule's FLOPs per token grow with the chunk (C² and C·K terms)."""
    import jax
    from flax import nnx

    from jaxtrain.models.transformer import ModelSpec, Transformer

    spec = ModelSpec.from_config(_hybrid())
    model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0)))
    layer = model.linear_blocks.attn
    weights = sum(getattr(layer, n).value.size for n in ("w_q", "w_k", "w_v", "w_z", "w_a",
                                                        "w_b", "w_o")) // 3
    assert spec.linear.matmul_params(spec.d_model) == weights
    for length in (16, 64):
        cache = jax.eval_shape(lambda m=model, n=length: m.init_cache(1, n))
        state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache["linear_blocks"]))
        assert spec.linear.state_bytes(4) * 3 == state
    flops = [spec.linear.delta_rule_flops_per_token(c) for c in (16, 64, 256)]
    assert flops[0] < flops[1] < flops[2]
