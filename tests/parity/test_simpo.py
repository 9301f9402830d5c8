"""train.objective='simpo': SimPO on rows of pairs, against TRL's CPOTrainer (loss_type=
'simpo', cpo_alpha=0) on the same per-reply mean log-probabilities, and a tiny run."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from jaxtrain.config import validate
from jaxtrain.errors import ConfigError
from jaxtrain.objectives import OBJECTIVES, SIMPO_METRICS, simpo_per_pair


def _trl_cpo_loss(chosen, rejected, beta, gamma, smoothing):
    """TRL's own CPOTrainer.cpo_loss, called on a stand-in `self` (no trainer, no model)."""
    torch = pytest.importorskip("torch")
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    me = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta,
                               label_smoothing=smoothing,
                               accelerator=types.SimpleNamespace(device="cpu"))
    c = torch.tensor(chosen, dtype=torch.float64, requires_grad=True)
    r = torch.tensor(rejected, dtype=torch.float64, requires_grad=True)
    losses, chosen_rewards, rejected_rewards = cpo.CPOTrainer.cpo_loss(me, c, r)
    losses.mean().backward()
    return losses.detach().numpy(), chosen_rewards.numpy(), rejected_rewards.numpy(), \
        c.grad.numpy(), r.grad.numpy()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_equals_trls_cpo_loss_and_gradient(smoothing):
    """A fixed batch of mean log-probabilities: loss per pair, its gradient w.r.t. both
    replies' scores, and the reward metrics equal TRL's within 1e-5 (float32 vs float64)."""
    rng = np.random.default_rng(0)
    chosen, rejected = (-rng.uniform(0.2, 4.0, 16) for _ in range(2))
    beta, gamma = 2.0, 1.0
    trl_loss, trl_c, trl_r, grad_c, grad_r = _trl_cpo_loss(chosen, rejected, beta, gamma,
                                                           smoothing)

    def mean_loss(c, r):
        per = simpo_per_pair(c, r, beta, gamma, smoothing)
        return per["loss"].mean(), per

    (value, per), grads = jax.value_and_grad(mean_loss, argnums=(0, 1), has_aux=True)(
        jnp.asarray(chosen, jnp.float32), jnp.asarray(rejected, jnp.float32))
    np.testing.assert_allclose(per["loss"], trl_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(value), trl_loss.mean(), rtol=1e-5)
    np.testing.assert_allclose(grads[0], grad_c, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads[1], grad_r, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(per["rewards/chosen"], trl_c, rtol=1e-5)
    np.testing.assert_allclose(per["rewards/rejected"], trl_r, rtol=1e-5)
    np.testing.assert_allclose(per["rewards/accuracies"], (trl_c > trl_r).astype(float))
    assert set(per) == {"loss", *SIMPO_METRICS}


def test_simpo_scores_are_trls_mean_log_probabilities(devices):
    """Our per-reply score is TRL's get_batch_logps(average_log_prob=True) of the reply
    alone: the policy's logits of each document in PyTorch, right-padded, labels -100 off
    the reply, against segment_logps' sums over counts on the packed row of pairs."""
    torch = pytest.importorskip("torch")
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    from test_dpo import SHAPE, _pairs

    from jaxtrain.data.batches import to_global
    from jaxtrain.objectives import mean_logps
    from jaxtrain.train.setup import build

    cfg = small_config("llama", **{**SHAPE, "train.objective": "simpo",
                                   "data.source": "prepared", "data.path": "unused",
                                   "data.packing": "pairs"})
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    batch, docs = _pairs(np.random.default_rng(3), 4, cfg.model.seq_len, 128)
    with jax.set_mesh(setup.mesh):
        c, r, _, _ = jax.jit(lambda p, b: mean_logps(p, setup.graphdef, b))(
            state.params, to_global(batch, setup.tokens_sharding))
    # the model's logits for each document alone, from our own forward (no packing)
    from flax import nnx
    model = nnx.merge(setup.graphdef, jax.device_get(state.params))
    theirs = []
    for ids, mask in docs:
        logits = np.asarray(model(jnp.asarray(ids[None, :], jnp.int32)), np.float64)
        labels = np.where(mask > 0, ids, -100)[None]
        theirs.append(float(cpo.CPOTrainer.get_batch_logps(
            torch.from_numpy(logits), torch.from_numpy(labels), average_log_prob=True)[0]))
    np.testing.assert_allclose(np.r_[np.asarray(c), np.asarray(r)], theirs, rtol=1e-5)


def test_simpo_is_reference_free_and_checks_its_keys():
    from jaxtrain.plan.memory import estimate
    from jaxtrain.plan.timing import step_features  # noqa: F401 (reads reference_forwards)

    entry = OBJECTIVES["simpo"]
    assert entry.reference_forwards == 0 and not entry.holds_reference
    base = {"train.objective": "simpo", "data.source": "prepared", "data.path": "x",
            "data.packing": "pairs"}
    sizes = {a: 1 for a in ("data", "pipeline", "fsdp", "expert", "context", "tensor")}
    dpo = estimate(small_config("llama", **{**base, "train.objective": "dpo"}), sizes)
    simpo = estimate(small_config("llama", **base), sizes)
    lm = estimate(small_config("llama"), sizes)
    assert simpo["params"] == lm["params"] < dpo["params"]  # no reference copy
    for key, value, says in [("train.simpo.beta", 0.0, "train.simpo.beta"),
                             ("train.simpo.label_smoothing", 0.5, "label_smoothing"),
                             ("data.packing", "documents", "data.packing='pairs'"),
                             ("train.dpo.reference", "runs/x", "goes with train.objective"),
                             ("data.source", "synthetic", "data.source='prepared'")]:
        with pytest.raises(ConfigError, match=says) as e:
            validate(small_config(**{**base, key: value}), 1, "cpu")
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_simpo_run_trains_and_eval_reports_its_metrics(tmp_path, devices):
    from test_dpo import _jsonl, _prepare, _random_pairs

    from jaxtrain import inference
    from jaxtrain.commands import eval as eval_cmd
    from jaxtrain.metrics_log import read_metrics
    from jaxtrain.train.loop import run

    assert _prepare(_jsonl(tmp_path / "p.jsonl", _random_pairs()), tmp_path / "d") == 0
    cfg = small_config("gpt2", steps=8, **{
        "train.objective": "simpo", "data.source": "prepared", "data.path": str(
            tmp_path / "d"), "data.packing": "pairs", "model.seq_len": 192,
        "train.global_batch": 8, "model.num_layers": 1, "eval_batches": 1,
        "optimizer.lr": 1e-2, "eval_every_steps": 8})
    run(cfg, tmp_path / "run", devices[:1])
    rows = [r for r in read_metrics(tmp_path / "run", say=lambda _: None) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(name in rows[-1] for name in SIMPO_METRICS)
    _, cfg = inference.run_config(tmp_path / "run")
    name, windows, _ = inference.evaluation_windows(cfg, None)
    batches = eval_cmd.batch_count(name, windows, 8, None, cfg.eval_batches)
    result = eval_cmd.evaluate_windows(inference.load(tmp_path / "run", batch=8), windows,
                                       batches)
    assert set(result) == {"loss", *SIMPO_METRICS, "pairs"} and result["pairs"] == 2
