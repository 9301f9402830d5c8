"""The optimizer and the sharding rules against values worked out independently of the code
under test: one AdamW step with clipping and the decay mask done by hand in numpy on the
real parameter tree, and logical_to_spec on hand-written cases."""

import jax
import numpy as np
import pytest
from conftest import small_config
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from jaxtrain.data.batches import make_batches, to_global
from jaxtrain.mesh import DEFAULT_RULES, active_rules, logical_to_spec
from jaxtrain.train.setup import build
from jaxtrain.train.step import loss_fn

# What AdamW decays, written out by name (not with optim.decay_mask): the matmul weights and
# a separate output head; never norms, biases, or (by default) the embeddings.
DECAYED = {"w_q", "w_k", "w_v", "w_o", "w_up", "w_down", "w_gate", "lm_head"}


def _adamw_by_hand(params, grads, cfg):
    """One AdamW step from zero moments, in float64 numpy: global-norm clipping, bias
    correction, decoupled weight decay on DECAYED only; lr at step 0 of the warm-up."""
    o = cfg.optimizer
    flat_p = {k: np.asarray(v, np.float64) for k, v in traverse_util.flatten_dict(params).items()}
    flat_g = {k: np.asarray(v, np.float64) for k, v in traverse_util.flatten_dict(grads).items()}
    norm = np.sqrt(sum((g * g).sum() for g in flat_g.values()))
    clip = min(1.0, o.clip_norm / norm)
    lr = o.lr / o.warmup_steps  # the warm-up starts at lr/warmup_steps
    out = {}
    for path, p in flat_p.items():
        g = flat_g[path] * clip
        m_hat = (1 - o.b1) * g / (1 - o.b1)
        v_hat = (1 - o.b2) * g * g / (1 - o.b2)
        update = m_hat / (np.sqrt(v_hat) + o.eps)
        if path[-1] in DECAYED:
            update = update + o.weight_decay * p
        out[path] = p - lr * update
    return out, norm


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_adamw_step_equals_the_update_by_hand(family, devices):
    cfg = small_config(family, **{"steps": 100, "optimizer.clip_norm": 0.05,
                                  "optimizer.weight_decay": 0.5,
                                  "optimizer.warmup_steps": 4, "optimizer.lr": 1e-2})
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    tokens = to_global(next(make_batches(cfg).train_iter(0)), setup.tokens_sharding)
    params0 = jax.tree.map(np.asarray, state.params)
    grads = jax.grad(loss_fn)(state.params, setup.graphdef, tokens)
    want, norm = _adamw_by_hand(params0, grads, cfg)
    assert norm > 4 * cfg.optimizer.clip_norm, "clipping must be active for this test"
    with jax.set_mesh(setup.mesh):
        new_state, metrics = setup.train_step()(state, tokens)
    np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-5)
    got = traverse_util.flatten_dict(jax.tree.map(np.asarray, new_state.params))
    assert set(got) == set(want)
    decayed = {path[-1] for path in got if path[-1] in DECAYED}
    assert decayed >= {"w_q", "w_o", "w_up", "w_down"}
    before = traverse_util.flatten_dict(params0)
    for path, value in got.items():
        step = want[path] - before[path]
        err = np.abs(value - want[path]).max() / max(np.abs(step).max(), 1e-12)
        assert err < 1e-3, f"{'/'.join(path)}: off by {err:.2e} of the step"


@pytest.mark.parametrize("axes,sequence_parallel,expected", [
    # Weights: embed over fsdp, heads/mlp/vocab over tensor, the layer stack over pipeline.
    (("embed", "heads", "kv"), False, P("fsdp", "tensor", None)),
    (("layers", "embed", "mlp"), False, P("pipeline", "fsdp", "tensor")),
    (("vocab", "embed"), False, P("tensor", "fsdp")),
    # Activations: batch takes data, fsdp and expert, so embed (which wants fsdp) is
    # replicated.
    (("batch", "length", "embed"), False, P(("data", "fsdp", "expert"), None, None)),
    # The residual stream's length goes over tensor only with sequence parallelism.
    (("batch", "sequence", "embed"), False, P(("data", "fsdp", "expert"), None, None)),
    (("batch", "sequence", "embed"), True, P(("data", "fsdp", "expert"), "tensor", None)),
    # heads took tensor: mlp, which wants it too, is replicated; unknown names replicated.
    (("heads", "mlp"), False, P("tensor", None)),
    ((None, "nonsense"), False, P(None, None)),
])
def test_logical_axes_map_to_mesh_axes(axes, sequence_parallel, expected):
    rules = active_rules(DEFAULT_RULES, sequence_parallel)
    assert logical_to_spec(axes, rules) == expected


def test_a_rule_listing_several_mesh_axes_is_all_or_nothing():
    rules = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("other", ("fsdp", "tensor")))
    assert logical_to_spec(("embed", "other"), rules) == P("fsdp", None)
    assert logical_to_spec(("other", "embed"), rules) == P(("fsdp", "tensor"), None)


def test_lion_trains_and_the_planner_counts_its_one_moment(devices):
    """Lion (optim.OPTIMIZERS) lowers the loss, keeps one moment (no Adam nu), and the
    planner's optimizer state is half AdamW's, from the entry's state_per_param."""
    from helpers import train_steps

    from jaxtrain.config import validate
    from jaxtrain.optim import adam_moments
    from jaxtrain.plan import memory

    cfg = small_config(**{"optimizer.name": "lion", "optimizer.lr": 3e-4, "steps": 100})
    losses, _, state = train_steps(cfg, devices[:1], steps=4)
    assert losses[-1] < losses[0]
    mu, nu = adam_moments(state.opt_state)
    assert mu is not None and nu is None
    sizes = validate(cfg, 1)
    lion = memory.estimate(cfg, sizes)["optimizer"]
    adamw = memory.estimate(small_config(), sizes)["optimizer"]
    assert lion == adamw / 2
