"""End to end: the loop and the CLI train, log, evaluate, checkpoint and resume."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import small_config

from jaxtrain.train.loop import run
from jaxtrain.xla_flags import with_device_count

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_short_run_lowers_validation_loss_and_writes_its_outputs(tmp_path, devices):
    cfg = small_config(**{"steps": 60, "log_every_steps": 10, "eval_every_steps": 30,
                          "optimizer.lr": 3e-3, "optimizer.warmup_steps": 10})
    rows = run(cfg, tmp_path, devices[:1])
    logged = _rows(tmp_path)
    val = [r["val_loss"] for r in logged if "val_loss" in r]
    assert [r["step"] for r in logged if "val_loss" in r] == [0, 30, 60]
    assert val[-1] < 0.8 * val[0], val
    train_rows = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train_rows] == [10, 20, 30, 40, 50, 60]
    for key in ("loss", "learning_rate", "grad_norm", "tokens_per_s", "step_time_s", "mfu"):
        assert all(np.isfinite(r[key]) for r in train_rows), key
    assert all(0 < r["mfu"] < 1 for r in train_rows)
    assert train_rows == [{k: v for k, v in r.items()} for r in rows]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 60
    assert (tmp_path / "checkpoints" / "60").is_dir()


def test_resume_continues_the_same_run(tmp_path, devices):
    cfg = small_config(**{"steps": 6, "checkpoint.every_steps": 3})
    whole = run(cfg, tmp_path / "whole", devices[:1])
    run(cfg, tmp_path / "split", devices[:1])
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "6")  # as if stopped before step 6
    resumed = run(cfg, tmp_path / "split", devices[:1])
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]


def _cli_losses(workdir, device_count, *overrides):
    env = dict(os.environ, XLA_FLAGS=with_device_count(device_count))
    subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config", "configs/tiny.py",
                    "--config.steps=3", "--config.log_every_steps=1", f"--workdir={workdir}",
                    *overrides], cwd=ROOT, env=env, check=True, timeout=600,
                   capture_output=True)
    return [r["loss"] for r in _rows(workdir) if "loss" in r]


@pytest.mark.slow
def test_cli_on_a_3d_mesh_logs_the_single_device_losses(tmp_path):
    single = _cli_losses(tmp_path / "single", 1)
    mesh = _cli_losses(tmp_path / "mesh", 8, "--config.mesh.data=2", "--config.mesh.fsdp=2",
                       "--config.mesh.tensor=2")
    assert len(single) == 3
    np.testing.assert_allclose(mesh, single, rtol=0, atol=1e-5)
