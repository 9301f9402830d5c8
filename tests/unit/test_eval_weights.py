"""Evaluation means over units (issue 35 items 5 and 7): the in-training val_loss and
`jaxtrain eval` weigh each batch by its counted targets (pairs for DPO), a batch with none
adding nothing, against a float64 numpy reference over uneven batches; a DPO evaluation
reports the DPO loss and TRL's rewards, weighted by pairs; a small split is evaluated with
the batches it has."""

import jax
import numpy as np
import pytest
from conftest import small_config
from flax import nnx

from jaxtrain.commands import eval as eval_cmd
from jaxtrain.data.batches import to_global
from jaxtrain.data.packing import Packed, batch_targets
from jaxtrain.errors import DataError
from jaxtrain.inference import LoadedModel
from jaxtrain.objectives import DPO_METRICS, pair_logps
from jaxtrain.train.evaluation import Evaluator
from jaxtrain.train.setup import build

ROWS, SEQ = 4, 32


def _rows(rng, counted: list[int]) -> list[Packed]:
    """Packed rows of one document each, `n` counted targets per row (the loss mask on the
    last n targets; n = 0: an all-masked row)."""
    out = []
    for n in counted:
        tokens = rng.integers(1, 256, SEQ + 1).astype(np.int32)
        segments = np.ones(SEQ + 1, np.int32)
        mask = np.zeros(SEQ + 1, np.int32)
        if n:
            mask[-n:] = 1
        out.append(Packed(tokens, segments, np.arange(SEQ + 1, dtype=np.int32), mask))
    return out


def _stack(rows):
    return jax.tree.map(lambda *r: np.stack(r), *rows)


def _numpy_mean_nll(setup, params, rows) -> float:
    """float64: sum of -log p(target) over every counted target / their number."""
    model = nnx.merge(setup.graphdef, params)
    batch = _stack(rows)
    logits = np.asarray(jax.device_get(model(
        batch.tokens[:, :-1], batch.segments[:, :-1], batch.positions[:, :-1])), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch.tokens[:, 1:, None], -1)[..., 0]
    counted = np.asarray(batch_targets(batch))
    return float(nll[counted].sum() / counted.sum())


@pytest.fixture(scope="module")
def sft(devices):
    cfg = small_config(**{"data.source": "synthetic", "data.packing": "documents",
                          "train.global_batch": ROWS,
                          "model.seq_len": SEQ})
    setup = build(cfg, devices[:1])
    return cfg, setup, setup.init_state()


# 4 batches of 4 rows: 120, 40, 3 and 0 counted targets (an all-masked batch).
COUNTS = [30, 30, 30, 30, 10, 10, 10, 10, 3, 0, 0, 0, 0, 0, 0, 0]


def test_val_loss_is_the_mean_over_counted_targets_not_over_batches(sft):
    cfg, setup, state = sft
    rows = _rows(np.random.default_rng(0), COUNTS)
    batches = [to_global(_stack(rows[i:i + ROWS]), setup.tokens_sharding)
               for i in range(0, len(rows), ROWS)]
    with jax.set_mesh(setup.mesh):
        evaluator = Evaluator(setup.eval_step(), batches, 1, logger=None)
        value = evaluator.evaluate(state)
    expected = _numpy_mean_nll(setup, state.params, rows)
    np.testing.assert_allclose(value, expected, rtol=2e-6)


def test_jaxtrain_eval_weighs_batches_and_pads_the_last_of_a_small_split(sft):
    """7 rows at 4 a batch: two batches, the second padded with an empty row; the default
    (the run's eval_batches, 4) is cut to the 2 the split holds."""
    cfg, setup, state = sft
    windows = _rows(np.random.default_rng(1), [32, 5, 0, 1, 17, 0, 2])
    batches = eval_cmd.batch_count("validation split", windows, ROWS, None, 4)
    assert batches == 2
    loaded = LoadedModel(cfg=cfg, setup=setup, params=state.params, step=0)
    result = eval_cmd.evaluate_windows(loaded, windows, batches)
    assert result["tokens"] == 32 + 5 + 1 + 17 + 2
    np.testing.assert_allclose(result["loss"], _numpy_mean_nll(setup, state.params, windows),
                               rtol=2e-6)
    np.testing.assert_allclose(result["bits_per_token"], result["loss"] / np.log(2))
    with pytest.raises(DataError, match="holds 7 rows: fewer than 3 batches of 4") as e:
        eval_cmd.batch_count("validation split", windows, ROWS, 3, 4)
    assert "\n" not in str(e.value)


def _pair_rows(rng, rows: int) -> list[Packed]:
    """Rows of one pair each (segment 1 chosen, 2 rejected; masks on the replies)."""
    out = []
    for _ in range(rows):
        arrays = np.zeros((4, SEQ + 1), np.int32)
        prompt = rng.integers(1, 256, int(rng.integers(2, 6)))
        at = 0
        for k in (1, 2):
            reply = rng.integers(1, 256, int(rng.integers(2, 10)))
            ids = np.r_[prompt, reply]
            n = len(ids)
            arrays[:, at:at + n] = np.stack([ids, np.full(n, k), np.arange(n),
                                             np.r_[np.zeros(len(prompt)), np.ones(len(reply))]])
            at += n
        out.append(Packed(*arrays))
    return out


def test_jaxtrain_eval_of_a_dpo_run_reports_the_dpo_loss_and_rewards_by_pairs(devices):
    """5 pairs at 4 a batch (the second batch holds one pair and 3 empty rows): the DPO
    loss, rewards and accuracy equal the means over the 5 pairs of TRL's formulas in float64,
    on the log-likelihoods of the policy (moved off the reference) and the reference."""
    beta = 0.1
    cfg = small_config("llama", **{
        "train.objective": "dpo", "train.dpo.beta": beta, "data.source": "prepared",
        "data.path": "unused", "data.packing": "pairs", "train.global_batch": ROWS,
        "model.seq_len": SEQ})
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    policy = jax.tree.map(lambda x: x * 1.05, state.params)
    loaded = LoadedModel(cfg=cfg, setup=setup, params=policy, step=0)
    windows = _pair_rows(np.random.default_rng(2), 5)
    batches = eval_cmd.batch_count("validation split", windows, ROWS, None, cfg.eval_batches)
    result = eval_cmd.evaluate_windows(loaded, windows, batches)
    assert batches == 2 and result["pairs"] == 5 and "perplexity" not in result
    assert set(result) == {"loss", *DPO_METRICS, "pairs"}

    reference = eval_cmd._reference(loaded)
    batch = _stack(windows)
    logps = [np.asarray(jax.device_get(pair_logps(p, setup.graphdef, batch)[:2]), np.float64)
             for p in (policy, reference)]
    (pc, pr), (rc, rr) = logps
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    expected = {"loss": np.mean(np.log1p(np.exp(-(chosen - rejected)))),
                "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                "rewards/margins": (chosen - rejected).mean(),
                "rewards/accuracies": (chosen > rejected).mean(),
                "logps/chosen": pc.mean(), "logps/rejected": pr.mean()}
    assert 0 < expected["rewards/accuracies"] < 1
    for name, value in expected.items():
        np.testing.assert_allclose(result[name], value, rtol=2e-5, atol=1e-6, err_msg=name)
    with pytest.raises(DataError, match="evaluated on its pairs") as e:  # text has no pairs
        eval_cmd.check_data(setup.objective, "val.txt")
    assert "\n" not in str(e.value)
