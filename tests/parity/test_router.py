"""DeepSeek-V3's MoE (models/router.py): the sigmoid/bias router with group limits and the
shared experts against transformers' DeepseekV3MoE (copied weights), on both dispatch
paths and under expert parallelism; the aux-loss-free bias update against a float64 numpy
implementation of the DeepSeek-V3 report's rule."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from jaxtrain.config import ConfigError
from jaxtrain.mesh import DEFAULT_RULES, MESH_AXES, active_rules
from jaxtrain.models import ModelSpec
from jaxtrain.models import moe as moe_lib
from jaxtrain.models import router as router_lib

D, E, F, K, SHARED = 16, 8, 12, 3, 2


def _hf_moe(n_group: int, topk_group: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=K,
                           moe_intermediate_size=F, n_shared_experts=SHARED, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=True,
                           routed_scaling_factor=2.5)
    hf = DeepseekV3MoE(cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.1)
    return hf


def _spec(dispatch: str, e=E, rules=()):
    moe = moe_lib.MoeSpec(num_experts=e, top_k=K, expert_mlp_dim=F, shared_experts=SHARED,
                          dispatch=dispatch, capacity_factor=e / K)  # room for every row
    return ModelSpec("llama", D, 2, 2, 2, D // 2, F, 32, 12, moe=moe, rules=rules)


def _router(n_group: int, topk_group: int) -> router_lib.RouterSpec:
    return router_lib.RouterSpec("sigmoid_bias", n_group, topk_group, True, 2.5)


def _copied(hf, spec, router) -> router_lib.DeepSeekMoe:
    """The jaxtrain layer holding the transformers layer's weights."""
    layer = router_lib.DeepSeekMoe(spec, router, rngs=nnx.Rngs(0))
    t = lambda w: jnp.asarray(w.detach().numpy())  # noqa: E731
    gate_up = hf.experts.gate_up_proj.detach().numpy()  # [E, 2F, D]: gate rows, then up
    layer.w_router[...] = t(hf.gate.weight).T
    layer.w_gate[...] = jnp.asarray(gate_up[:, :F].transpose(0, 2, 1))
    layer.w_up[...] = jnp.asarray(gate_up[:, F:].transpose(0, 2, 1))
    layer.w_down[...] = t(hf.experts.down_proj).transpose(0, 2, 1)
    layer.e_score_correction_bias[...] = t(hf.gate.e_score_correction_bias)
    shared = hf.shared_experts
    layer.shared.w_gate[...] = t(shared.gate_proj.weight).T
    layer.shared.w_up[...] = t(shared.up_proj.weight).T
    layer.shared.w_down[...] = t(shared.down_proj.weight).T
    return layer


def _x(seed=1, b=2, length=10):
    return np.random.default_rng(seed).normal(size=(b, length, D)).astype(np.float32)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_deepseek_moe_equals_transformers_and_group_limits_change_the_choice(dispatch):
    x = _x()
    chosen = {}
    for n_group, topk_group in ((4, 2), (1, 1)):
        hf = _hf_moe(n_group, topk_group)
        with torch.no_grad():
            want = hf(torch.from_numpy(x)).numpy()
            chosen[n_group] = hf.gate(torch.from_numpy(x))[2].sort(-1).values.numpy()
        layer = _copied(hf, _spec(dispatch), _router(n_group, topk_group))
        y, stats = nnx.jit(lambda m, x: m(x))(layer, x)
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
        assert float(stats["load"].sum()) == K * x.shape[0] * x.shape[1]
    # The same weights and bias with and without the group limit pick differently: the
    # limit is exercised, not vacuous.
    assert (chosen[4] != chosen[1]).any()


def _loss_and_grads(layer, x, mesh=None):
    def loss(m, x):
        y, stats = m(x)
        return (y * y).mean(), stats["load"].sum(0)

    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    f = jax.jit(jax.value_and_grad(lambda p, x: loss(nnx.merge(graphdef, p, rest), x),
                                   has_aux=True))
    if mesh is None:
        return f(params, x)
    with jax.set_mesh(mesh):
        return f(params, x)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_parallel_equals_one_device(dispatch, devices):
    """expert=2 (dropless: the ragged exchange's CPU stand-in; capacity: the fixed
    all-to-all) against no mesh: loss, loads and every gradient."""
    hf = _hf_moe(4, 2)
    x = _x(b=4, length=6)
    one = _loss_and_grads(_copied(hf, _spec(dispatch), _router(4, 2)), x)
    mesh = jax.make_mesh((1, 1, 1, 2, 1, 1), MESH_AXES, devices=devices[:2],
                         axis_types=(jax.sharding.AxisType.Auto,) * 6)
    rules = active_rules(DEFAULT_RULES, False)
    two = _loss_and_grads(_copied(hf, _spec(dispatch, rules=rules), _router(4, 2)), x, mesh)
    (loss1, load1), g1 = one
    (loss2, load2), g2 = two
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    np.testing.assert_array_equal(load2, load1)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert float(optax_norm(g1)) > 0


def optax_norm(tree):
    return jnp.sqrt(sum((leaf * leaf).sum() for leaf in jax.tree.leaves(tree)))


def _numpy_bias_update(bias_NE, load_NE, gamma):
    """DeepSeek-V3 report §2.1.2, float64: "decrease the bias term by γ if its corresponding
    expert is overloaded and increase it by γ if its corresponding expert is underloaded"
    (over/under: against the layer's mean load; an expert exactly at the mean stays)."""
    bias = np.asarray(bias_NE, np.float64).copy()
    load = np.asarray(load_NE, np.float64)
    mean = load.mean(-1, keepdims=True)
    bias[load > mean] -= gamma
    bias[load < mean] += gamma
    return bias


def test_bias_update_follows_the_report_and_balances_the_load():
    # One rule application with ties (loads equal to the mean) against numpy.
    load = np.array([[3, 3, 3, 3], [1, 5, 3, 3], [0, 0, 0, 12]], np.float32)
    bias = np.random.default_rng(0).normal(size=load.shape).astype(np.float32)
    got = router_lib.updated_bias(jnp.asarray(bias), jnp.asarray(load), 0.01)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, _numpy_bias_update(bias, load, 0.01), atol=1e-7)
    np.testing.assert_array_equal(got[0], bias[0])  # balanced: unchanged
    # Steps of routing and update, the loads from the layer: the float32 bias follows the
    # float64 rule step by step, and the busiest expert's load comes down.
    hf = _hf_moe(4, 2)
    with torch.no_grad():  # experts 0 and 1 start far ahead: nearly every token takes them
        hf.gate.e_score_correction_bias.copy_(torch.tensor([0.3, 0.3] + [0.0] * (E - 2)))
    layer = _copied(hf, _spec("capacity"), _router(4, 2))
    x = _x(seed=3, b=4, length=16)
    step = nnx.jit(lambda m, x: m(x)[1]["load"].sum(0))
    bias64 = np.asarray(layer.e_score_correction_bias[...], np.float64)[None]
    ratios = []
    for _ in range(30):
        load_E = step(layer, x)
        ratios.append(float(load_E.max() / load_E.mean()))
        new = router_lib.updated_bias(layer.e_score_correction_bias[...][None], load_E[None],
                                      0.02)
        bias64 = _numpy_bias_update(bias64, np.asarray(load_E)[None], 0.02)
        np.testing.assert_allclose(new, bias64, atol=1e-6)
        layer.e_score_correction_bias[...] = new[0]
    assert ratios[0] > 2.0 and min(ratios[-5:]) < 0.6 * ratios[0], ratios
    # State, not a trained parameter: no gradient reaches it (it only picks experts). It
    # rides in the parameter tree as a CorrectionBias, whose update the step makes
    # (test_convert_deepseek_v3.py checks the step's).
    grads = nnx.grad(lambda m, x: (m(x)[0] ** 2).sum())(layer, x)
    assert isinstance(layer.e_score_correction_bias, router_lib.CorrectionBias)
    assert not np.asarray(grads["e_score_correction_bias"][...]).any()
    assert np.abs(np.asarray(grads["w_router"][...])).max() > 0


@pytest.mark.parametrize("overrides, match", [
    ({"router": "softmx"}, "model.moe.router='softmx' is invalid: valid values are softmax, "
                           "sigmoid_bias, softmax_group"),
    ({"n_group": 3}, "model.moe.n_group=3 is invalid"),
    ({"topk_group": 5}, "model.moe.topk_group=5 is invalid"),
    ({"n_group": 4, "topk_group": 1}, "model.moe.top_k=3 is invalid"),
    ({"bias_update_rate": -1.0}, "model.moe.bias_update_rate=-1.0 is invalid"),
])
def test_router_config_errors_name_the_key(overrides, match):
    moe = {**router_lib.defaults(), "router": "sigmoid_bias", "num_experts": E, "top_k": K,
           "n_group": 4, "topk_group": 2, **overrides}
    c = ml_collections.ConfigDict({"model": {"moe": moe}})
    with pytest.raises(ConfigError, match=match.replace("(", r"\(")):
        router_lib.check(c)
    moe_ok = {**moe, **{"router": "sigmoid_bias", "n_group": 4, "topk_group": 2,
                        "bias_update_rate": 0.0}}
    router_lib.check(ml_collections.ConfigDict({"model": {"moe": moe_ok}}))
    assert router_lib.RouterSpec.from_config(
        ml_collections.ConfigDict(moe_ok)) == router_lib.RouterSpec(
        "sigmoid_bias", 4, 2, True, 1.0, 0.0)
