"""Metric sinks (jaxtrain/sinks.py SINKS): the registry, its config errors, and an offline
Weights & Biases run whose history is metrics.jsonl's, across a resume. Task scores reaching
every sink: tests/e2e/test_tasks.py."""

import json
import math

import pytest
from conftest import small_config
from log_readers import metrics_rows, rows_by_step

from jaxtrain.config import validate
from jaxtrain.errors import ConfigError


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory, devices):
    """A byte-level run of 4 steps logging to metrics.jsonl and an offline W&B run (with a
    validation loss every 2 steps), then resumed to step 6."""
    from jaxtrain.train.loop import run

    workdir = tmp_path_factory.mktemp("run")
    cfg = small_config(**{"steps": 4, "log_every_steps": 2, "eval_every_steps": 2,
                          "checkpoint.every_steps": 2, "model.seq_len": 64,
                          "train.global_batch": 8, "metrics.sinks": "jsonl,wandb",
                          "metrics.wandb.mode": "offline"})
    run(cfg, workdir, devices[:1])
    cfg.steps = 6
    run(cfg, workdir, devices[:1])
    return workdir


@pytest.mark.slow
def test_wandb_offline_run_resumes_with_the_history_of_metrics_jsonl(wandb_run):
    from log_readers import wandb_runs

    runs = wandb_runs(wandb_run / "wandb")
    stored = json.loads((wandb_run / "wandb_run.json").read_text())["id"]
    assert [r["id"] for r in runs] == [stored, stored]  # the resumed run is the same run
    assert runs[0]["config"]["model"]["seq_len"] == 64
    assert runs[0]["config"]["eval_every_steps"] == 2
    logged = {}
    for run in runs:
        for row in run["history"]:
            logged.setdefault(row["_step"], {}).update(
                {k: v for k, v in row.items() if not k.startswith("_")})
    expected = rows_by_step(metrics_rows(wandb_run))
    assert sorted(logged) == sorted(expected) == [0, 2, 4, 6]
    for step, row in expected.items():
        assert logged[step].keys() == row.keys(), step
        for key, value in row.items():
            assert logged[step][key] == value or (math.isnan(value) and math.isnan(
                logged[step][key])), (step, key)


@pytest.mark.parametrize("overrides,message", [
    ({"metrics.sinks": "jsonl,mlflow"}, "'mlflow' is no sink; valid values are .*wandb"),
    ({"metrics.sinks": "tensorboard"}, "must include jsonl"),
    ({"metrics.sinks": "jsonl,wandb", "metrics.wandb.mode": "cloud"},
     "metrics.wandb.mode='cloud' is invalid: valid values are online, offline, disabled"),
])
def test_metrics_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(small_config(**overrides), 1, "cpu")


def test_a_new_metric_sink_is_one_registry_entry(tmp_path, monkeypatch):
    from jaxtrain import sinks
    from jaxtrain.metrics import MetricsWriter

    written = []

    class ListSink:
        def __init__(self, workdir, cfg, start_step):
            written.append(("open", start_step))

        def write(self, step, row):
            written.append((step, row))

        def close(self):
            written.append("closed")

    cfg = small_config(**{"metrics.sinks": "jsonl,mine"})
    with pytest.raises(ConfigError, match="'mine' is no sink"):
        validate(cfg, 1, "cpu")
    monkeypatch.setitem(sinks.SINKS, "mine", sinks.MetricSink("mine", "a list", ListSink))
    validate(cfg, 1, "cpu")
    writer = MetricsWriter(tmp_path, 10, 3, cfg=cfg)
    writer.write(4, {"step": 4, "loss": 1.5})
    writer.close()
    assert written == [("open", 3), (4, {"loss": 1.5}), "closed"]
    assert metrics_rows(tmp_path) == [{"step": 4, "loss": 1.5}]
    assert not (tmp_path / "tensorboard").exists()  # not among this run's sinks


def test_wandb_that_cannot_start_is_a_one_line_config_error(tmp_path, monkeypatch):
    import wandb

    from jaxtrain.sinks import WandbSink

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    cfg = small_config(**{"metrics.sinks": "jsonl,wandb"})
    with pytest.raises(ConfigError, match=r"W&B could not start a run \(No API key .*"
                                          "metrics.wandb.mode=offline$"):
        WandbSink(tmp_path, cfg, 0)
