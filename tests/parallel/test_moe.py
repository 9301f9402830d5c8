"""Mixture of experts: the layer against a per-token numpy reference, both dispatch paths,
the routing losses by hand, expert parallelism against one device, and decoding."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from helpers import assert_cached_decoding_matches_full_forward, assert_params_close, train_steps

from jaxtrain import hardware as catalog
from jaxtrain.config import ConfigError, validate
from jaxtrain.metrics import flops_per_token, matmul_params
from jaxtrain.models import ModelSpec
from jaxtrain.models import moe as moe_lib
from jaxtrain.models.stack import Groups
from jaxtrain.plan import memory, timing
from jaxtrain.plan.compile_check import load_config
from jaxtrain.plan.planner import make_plan
from jaxtrain.plan.search import candidates
from jaxtrain.train.setup import build

ROOT = pathlib.Path(__file__).resolve().parents[2]
MOE = {"model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.expert_mlp_dim": 64}


def moe_config(**overrides):
    return small_config("llama", **{**MOE, **overrides})


# ---------------------------------------------------------------------------------------
# The layer against a reference written token by token in numpy.

def _numpy_moe(x_TD, w_router, w_up, w_gate, w_down, k, capacity=None):
    """Each token through its top-k experts in token order; an expert that has taken
    `capacity` token×choice rows takes no more (those choices add nothing)."""
    logits = x_TD @ w_router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    taken = np.zeros(w_router.shape[1], int)
    y = np.zeros_like(x_TD)
    dropped = 0
    for t, x in enumerate(x_TD):
        top = np.argsort(-probs[t], kind="stable")[:k]
        weights = probs[t, top] / probs[t, top].sum()
        for e, w in zip(top, weights):
            if capacity is not None and taken[e] >= capacity:
                dropped += 1
                continue
            taken[e] += 1
            gate = x @ w_gate[e]
            y[t] += w * ((gate / (1 + np.exp(-gate)) * (x @ w_up[e])) @ w_down[e])
    return y, dropped


def _layer_inputs(e=8, d=16, f=24, b=2, length=12, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, length, d)).astype(np.float32)
    weights = (rng.normal(size=(d, e)), rng.normal(size=(e, d, f)) / d ** 0.5,
               rng.normal(size=(e, d, f)) / d ** 0.5, rng.normal(size=(e, f, d)) / f ** 0.5)
    return x, tuple(w.astype(np.float32) for w in weights)


def _spec(dispatch: str, capacity_factor: float = 1.25, e=8, k=2, d=16, f=24):
    moe = moe_lib.MoeSpec(num_experts=e, top_k=k, expert_mlp_dim=f, dispatch=dispatch,
                          capacity_factor=capacity_factor)
    return ModelSpec("llama", d, 2, 2, 2, d // 2, f, 32, 12, moe=moe)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_layer_equals_the_per_token_reference(dispatch):
    x, weights = _layer_inputs()
    spec = _spec(dispatch, capacity_factor=4.0)  # = E/k: room for every token
    y, stats = jax.jit(lambda x, w: moe_lib.routed_experts(spec, x, w, True))(x, weights)
    want, dropped = _numpy_moe(x.reshape(-1, 16), *weights, k=2)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), want, rtol=1e-4, atol=1e-5)
    assert dropped == 0 and float(stats["dropped"].sum()) == 0
    assert float(stats["load"].sum()) == 2 * 24  # every token×choice counted once


@pytest.mark.slow
def test_capacity_drops_the_late_tokens_and_counts_them():
    x, weights = _layer_inputs()
    spec = _spec("capacity", capacity_factor=0.5)
    cap = spec.moe.capacity(24, True)
    assert cap == 3  # ⌈0.5·24·2/8⌉ of each expert's 6 rows on average
    y, stats = moe_lib.routed_experts(spec, x, weights, True)
    want, dropped = _numpy_moe(x.reshape(-1, 16), *weights, k=2, capacity=cap)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), want, rtol=1e-4, atol=1e-5)
    assert dropped > 0 and float(stats["dropped"].sum()) == dropped
    # Decoding never drops: drop=False gives every expert room for all the tokens.
    y_all, stats = moe_lib.routed_experts(spec, x, weights, False)
    np.testing.assert_allclose(np.asarray(y_all).reshape(-1, 16),
                               _numpy_moe(x.reshape(-1, 16), *weights, k=2)[0],
                               rtol=1e-4, atol=1e-5)
    assert float(stats["dropped"].sum()) == 0


def test_routing_losses_by_hand():
    rng = np.random.default_rng(3)
    b, n, e, k, tokens = 4, 2, 4, 2, 4 * 8
    load = rng.integers(0, 5, (b, n, e)).astype(np.float32)
    prob = rng.random((b, n, e)).astype(np.float32)
    z = rng.random((b, n)).astype(np.float32)
    dropped = np.zeros((b, n), np.float32)
    dropped[0, 1] = 3
    moe = moe_lib.MoeSpec(num_experts=e, top_k=k, expert_mlp_dim=8, aux_loss_weight=0.5,
                          z_loss_weight=0.25)
    penalty, m = moe_lib.routing_losses(
        {"load": load, "prob": prob, "z": z, "dropped": dropped}, moe, tokens)
    f, p = load.sum(0) / tokens, prob.sum(0) / tokens
    aux = np.mean([e / k * sum(f[i, j] * p[i, j] for j in range(e)) for i in range(n)])
    zl = np.mean(z.sum(0) / tokens)
    np.testing.assert_allclose(m["moe_aux_loss"], aux, rtol=1e-6)
    np.testing.assert_allclose(m["moe_z_loss"], zl, rtol=1e-6)
    np.testing.assert_allclose(penalty, 0.5 * aux + 0.25 * zl, rtol=1e-6)
    per_layer = load.sum(0)
    np.testing.assert_allclose(m["moe_load_max"],
                               max(per_layer[i].max() / per_layer[i].mean() for i in range(n)))
    np.testing.assert_allclose(m["moe_dropped_fraction"], 3 / (tokens * k * n))


def test_balanced_routing_has_aux_loss_one():
    e, k, tokens = 4, 2, 8
    stats = {"load": np.full((1, 1, e), tokens * k / e, np.float32),
             "prob": np.full((1, 1, e), tokens / e, np.float32),
             "z": np.zeros((1, 1), np.float32), "dropped": np.zeros((1, 1), np.float32)}
    moe = moe_lib.MoeSpec(num_experts=e, top_k=k, expert_mlp_dim=8)
    _, m = moe_lib.routing_losses(stats, moe, tokens)
    np.testing.assert_allclose(m["moe_aux_loss"], 1.0)
    np.testing.assert_allclose(m["moe_load_max"], 1.0)


def test_gathered_all_to_all_is_ragged_all_to_all(devices):
    """The CPU stand-in, on the example of jax.lax.ragged_all_to_all's docstring."""
    mesh = jax.make_mesh((2,), ("x",), devices=devices[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    operand = jnp.asarray([[1, 2, 2], [3, 4, 0]], jnp.float32)[..., None]  # rows of width 1
    args = [jnp.asarray(a, jnp.int32) for a in (
        [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]

    def body(op, in_off, send, out_off, recv):
        out = moe_lib._gathered_all_to_all(op[0], jnp.zeros((4, 1)), in_off[0], send[0],
                                           out_off[0], recv[0], "x")
        return out[None, :, 0]

    spec = jax.sharding.PartitionSpec("x")
    with jax.set_mesh(mesh):
        got = jax.jit(jax.shard_map(body, in_specs=(spec,) * 5, out_specs=spec))(operand, *args)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


# ---------------------------------------------------------------------------------------
# In the model and the train step.

def test_dense_layers_and_moe_layers_interleave():
    cfg = moe_config(**{"model.num_layers": 4, "model.moe.every_n_layers": 2,
                        "model.moe.shared_experts": 1})
    setup = build(cfg, jax.devices()[:1])
    params = setup.abstract_state().params
    assert params["blocks"]["mlp"]["w_up"].shape == (2, 64, 128)  # layers 0 and 2: dense
    assert params["moe_blocks"]["mlp"]["w_up"].shape == (2, 8, 64, 64)  # layers 1 and 3
    assert params["moe_blocks"]["mlp"]["shared"]["w_up"].shape == (2, 64, 64)
    # Active parameters only: the router, k of E experts and the shared one per MoE layer.
    spec = setup.spec
    dense = small_config("llama", **{"model.num_layers": 4})
    dense_spec = build(dense, jax.devices()[:1]).spec
    per_moe_layer = 64 * 8 + 3 * 3 * 64 * 64
    assert matmul_params(spec) == (matmul_params(dense_spec) - 2 * 3 * 64 * 128
                                   + 2 * per_moe_layer)
    assert flops_per_token(spec) == 6 * matmul_params(spec) + (
        flops_per_token(dense_spec) - 6 * matmul_params(dense_spec))


@pytest.mark.parametrize("every_n,layers", [(0, 3), (1, 3), (2, 6), (3, 6)])
def test_the_walker_reads_each_layer_in_model_order(every_n, layers):
    """Groups (models/stack.py): layers n−1, 2n−1, ... are MoE; the kv cache, [layers, ...],
    split into the walker's per-group parts holds each kind's layers in order, and joins
    back as it was."""
    moe = moe_lib.MoeSpec(8, 2, 24, every_n_layers=every_n) if every_n else None
    groups = Groups.of(ModelSpec("llama", 16, layers, 2, 2, 8, 24, 32, 12, moe=moe))
    is_moe = (np.arange(layers) + 1) % every_n == 0 if every_n else np.zeros(layers, bool)
    np.testing.assert_array_equal(groups.moe_layers(), is_moe)
    cache = (np.arange(layers)[:, None] * np.ones(3), -np.arange(layers)[:, None] * np.ones(3))
    parts = groups.split(cache)
    for kind, chosen in (("dense", ~is_moe), ("moe", is_moe)):
        if not chosen.any():
            assert kind not in parts
            continue
        # Group g's layers of this kind, in order (its group axis first).
        got = np.asarray(parts[kind][0])[..., 0].reshape(groups.count, -1)
        np.testing.assert_array_equal(got, np.flatnonzero(chosen).reshape(groups.count, -1))
    for joined, original in zip(groups.join(parts), cache):
        np.testing.assert_array_equal(joined, original)


@pytest.mark.slow
def test_train_step_logs_routing_metrics(devices):
    cfg = moe_config(**{"model.moe.dispatch": "capacity", "model.moe.capacity_factor": 0.5})
    setup = build(cfg, devices[:1])
    from jaxtrain.data.batches import make_batches, to_global

    state = setup.init_state()
    tokens = to_global(next(make_batches(cfg).train_iter(0)), setup.tokens_sharding)
    with jax.set_mesh(setup.mesh):
        val = setup.eval_step()(state.params, tokens)  # sums over the targets
        _, metrics = setup.train_step()(state, tokens)  # donates the state
    m = {k: float(v) for k, v in metrics.items()}
    assert 0 < m["moe_dropped_fraction"] < 1
    assert m["moe_load_max"] >= 1 >= m["moe_load_min"] >= 0
    assert m["moe_aux_loss"] >= 1 - 1e-6 and m["moe_z_loss"] > 0
    # `loss` is the cross entropy (the objective adds the weighted router losses), as the
    # eval step reports it.
    np.testing.assert_allclose(m["loss"], float(val["loss"] / val["weight"]), rtol=1e-6)


@pytest.mark.slow
def test_the_objective_adds_the_weighted_router_losses(devices):
    """What the step differentiates is cross entropy + aux_loss_weight·aux + z_loss_weight·z;
    the logged `loss` is the cross entropy alone."""
    from jaxtrain.train.step import objective_fn

    def objective(aux: float, z: float):
        cfg = moe_config(**{"model.moe.aux_loss_weight": aux, "model.moe.z_loss_weight": z})
        setup = build(cfg, devices[:1])
        tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, 256)
        with jax.set_mesh(setup.mesh):
            return jax.jit(objective_fn, static_argnums=1)(setup.init_state().params,
                                                           setup.graphdef, tokens)

    (plain, m), (weighted, _) = objective(0.0, 0.0), objective(3.0, 7.0)
    np.testing.assert_allclose(plain, m["loss"], rtol=1e-6)
    np.testing.assert_allclose(weighted - plain, 3 * m["moe_aux_loss"] + 7 * m["moe_z_loss"],
                               rtol=1e-4)


# One device, dropless: the reference of the tests below (dropless routing does not depend
# on how the batch is split; capacity routing does, unless no token is dropped).
_references = {}


def _reference(layout: str, devices):
    if layout not in _references:
        _references[layout] = train_steps(moe_config(**_dispatch("dropless"), **LAYOUTS[layout]),
                                          devices[:1])
    return _references[layout]


def _dispatch(name: str) -> dict:
    return {"model.moe.dispatch": name, "model.moe.capacity_factor": 4.0}  # = E/k: no drops


LAYOUTS = {"every": {}, "every2_shared": {"model.num_layers": 4, "model.moe.every_n_layers": 2,
                                          "model.moe.shared_experts": 1}}


@pytest.mark.slow
def test_dropless_and_capacity_agree_when_nothing_drops(devices):
    ref_losses, ref_params, _ = _reference("every", devices)
    losses, params, _ = train_steps(moe_config(**_dispatch("capacity")), devices[:1])
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_params_close(params, ref_params, rtol=1e-5)


MESHES = {
    "expert8": ({"mesh.expert": 8}, "dropless", "every"),
    "expert4_data2": ({"mesh.expert": 4, "mesh.data": 2}, "dropless", "every"),
    "expert2_fsdp2_tensor2": ({"mesh.expert": 2, "mesh.fsdp": 2, "mesh.tensor": 2}, "dropless",
                              "every"),
    "expert2_fsdp2_tensor2_capacity": (
        {"mesh.expert": 2, "mesh.fsdp": 2, "mesh.tensor": 2}, "capacity", "every"),
    "expert2_fsdp2_pipeline2_every2_shared": (
        {"mesh.expert": 2, "mesh.fsdp": 2, "mesh.pipeline": 2}, "dropless", "every2_shared"),
}


@pytest.mark.slow  # each mesh compiles the model: over the fast tier's budget
@pytest.mark.parametrize("case", list(MESHES))
def test_expert_parallel_matches_single_device(case, devices):
    mesh, dispatch, layout = MESHES[case]
    ref_losses, ref_params, _ = _reference(layout, devices)
    losses, params, state = train_steps(
        moe_config(**_dispatch(dispatch), **LAYOUTS[layout], **mesh), devices)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0], "the steps must actually train"
    assert_params_close(params, ref_params, rtol=1e-5)
    # The experts are split over the expert axis, their model dimension over fsdp.
    w_up = state.params["moe_blocks"]["mlp"]["w_up"]  # [layers, E, D, F]
    shard = w_up.addressable_shards[0].data.shape
    assert shard[1] == 8 // mesh["mesh.expert"]
    assert shard[2] == 64 // mesh.get("mesh.fsdp", 1)


@pytest.mark.slow
@pytest.mark.parametrize("every_n", [2, 3])  # a group's dense layers: one, or an inner scan
def test_cached_decoding_gives_the_full_forward_logits(every_n, devices):
    cfg = moe_config(**{"model.num_layers": 2 * every_n, "model.moe.every_n_layers": every_n,
                        "model.moe.dispatch": "capacity", "train.global_batch": 1,
                        "model.moe.capacity_factor": 4.0, "model.init_std": 0.3})
    setup = build(cfg, devices[:1])
    params = setup.init_state().params
    assert_cached_decoding_matches_full_forward(setup, params)


@pytest.mark.parametrize("overrides,match", [
    ({"mesh.expert": 2, "mesh.data": 4, "model.moe.num_experts": 0}, "mesh.expert=2 is invalid"),
    ({"mesh.expert": 8, "model.moe.num_experts": 4}, "model.moe.num_experts=4 is invalid"),
    ({"model.moe.top_k": 9}, "model.moe.top_k=9 is invalid"),
    ({"model.moe.every_n_layers": 3}, "model.moe.every_n_layers=3 is invalid"),
    ({"model.family": "gpt2"}, "needs model.family='llama'"),
    ({"model.moe.dispatch": "sparse"}, "model.moe.dispatch='sparse' is invalid"),
    ({"model.moe.router_dtype": "float16"}, "model.moe.router_dtype='float16' is invalid"),
    ({"model.moe.capacity_factor": 0.0}, "model.moe.capacity_factor=0.0 is invalid"),
    ({"model.num_layers": 4, "model.moe.every_n_layers": 2, "mesh.pipeline": 4,
      "mesh.data": 2},
     "the 2 groups of layers"),
])
def test_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(moe_config(**overrides), 8)


def test_dispatch_defaults_per_backend():
    assert moe_lib.resolve_dispatch("auto", "cpu") == "capacity"
    assert moe_lib.resolve_dispatch("auto", "gpu") == "capacity"
    assert moe_lib.resolve_dispatch("auto", "tpu") == "dropless"
    assert moe_lib.resolve_dispatch("auto", "") == "capacity", "an unnamed platform: the \"*\" entry"
    assert moe_lib.resolve_dispatch("dropless", "cpu") == "dropless"


# ---------------------------------------------------------------------------------------
# The planner (jaxtrain/plan): no compiles here; the estimate against XLA's compiled step is
# checked on the MoE cases of plan/grid.py GRID and the shipped MoE configs (tests/unit/test_plan.py).

def _mixtral():
    return load_config(str(ROOT / "configs" / "mixtral_8x7b.py"), {})


def test_plan_counts_total_and_active_parameters():
    plan = make_plan(_mixtral(), catalog.get("TPU-v5p"), 64)
    # Mixtral-8x7B as published: 46.7B parameters, 12.9B active per token.
    assert plan["params"] == pytest.approx(46.7e9, rel=0.005)
    assert plan["active_params"] == pytest.approx(12.9e9, rel=0.005)
    assert plan["memory"]["fits"]
    # The expert axis's all-to-alls are on its critical path; a dense model has none.
    assert plan["time"]["comm_s"]["expert"] > 0


def test_expert_axis_splits_the_experts_and_its_traffic():
    cfg = moe_config(**{"mesh.expert": 8})
    sizes = validate(cfg, 8)
    one = dict(sizes, expert=1, data=8)
    spec = ModelSpec.from_config(cfg)
    experts = 2 * 8 * 3 * 64 * 64  # two MoE layers of 8 experts, three [64, 64] matrices
    assert memory.param_shards(spec, one)["total"] - memory.param_shards(spec, sizes)["total"] \
        == experts - experts // 8
    hw = catalog.get("H100-SXM")
    time = lambda s: timing.predict(cfg, s, hw, memory.param_shards(spec, s)["total"], {})  # noqa: E731
    assert time(sizes)["comm_s"]["expert"] > 0 == time(one)["comm_s"]["expert"]
    # Dropless across the expert axis provides for the worst case: every peer's rows.
    dropless = ModelSpec.from_config(moe_config(**{"model.moe.dispatch": "dropless"}))
    assert memory.routed_rows(dropless, 100, sizes) == 100 * 2 * 8
    # Capacity buffers: capacity_factor·k rows per token (the CPU default).
    assert spec.moe.dispatch == "capacity"
    assert memory.routed_rows(spec, 100, sizes) == 100 * 1.25 * 2


def test_search_considers_the_expert_axis():
    def experts(cfg):
        return {o["mesh.expert"] for o, _ in candidates(cfg, 8, 8)}

    assert experts(moe_config(**{"train.global_batch": 2})) == {1, 2, 4, 8}
    assert experts(small_config("llama", **{"train.global_batch": 2})) == {1}
