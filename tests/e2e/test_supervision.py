"""A run that hangs ends itself; a second, fast checkpoint tier; goodput across a restart
(issue 14, parts B and C; the multi-process parts are in test_multihost.py)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import small_config

from jaxtrain.train.checkpointing import local_tier_dir
from jaxtrain.train.goodput import Goodput
from jaxtrain.train.loop import run
from jaxtrain.train.preemption import StopRequest
from jaxtrain.train.watchdog import HUNG
from jaxtrain.xla_flags import with_device_count

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_hung_step_dumps_every_stack_and_exits_with_the_hung_code(tmp_path):
    env = dict(os.environ, XLA_FLAGS=with_device_count(1))
    began = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "jaxtrain.main", "--config", "configs/tiny.py",
         "--config.model.d_model=64", "--config.model.num_layers=2", "--config.steps=50",
         "--config.log_every_steps=1", "--config.debug.hang_at_step=4",
         "--config.train.step_timeout_s=5", f"--workdir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == HUNG, result.stderr[-3000:]
    assert "no step completed for 5s after step 4 (train.step_timeout_s)" in result.stderr
    assert "Thread 0x" in result.stderr and "data_with_faults" in result.stderr, \
        "every thread's stack, the stuck one included"
    assert time.time() - began < 300


@pytest.mark.slow
def test_the_local_tier_resumes_a_run_on_another_mesh(tmp_path, devices, capfd):
    local = tmp_path / "local"
    tiers = {"checkpoint.every_steps": 6, "checkpoint.local_dir": str(local),
             "checkpoint.local_every_steps": 2, "checkpoint.local_keep": 2}
    cfg = small_config(**{"steps": 9, **tiers})
    whole = run(cfg, tmp_path / "run", devices[:1])
    durable = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir()
                     if p.name.isdigit())
    own = local_tier_dir(str(local), tmp_path / "run")
    assert [p.name for p in local.iterdir()] == [own.name], "the run's own directory"
    fast = sorted(int(p.name) for p in (own / "checkpoints").iterdir() if p.name.isdigit())
    assert durable == [6, 9] and fast == [4, 8], "local saves in between, keeping 2"
    # Another run sharing the fast disk does not see this run's local checkpoints.
    other = run(small_config(**{"steps": 1, **tiers}), tmp_path / "other", devices[:1])
    assert [r["step"] for r in other] == [1]
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "9")  # as if killed before the end
    capfd.readouterr()
    moved = small_config(**{"steps": 9, "mesh.data": 2, "mesh.fsdp": 2, **tiers})
    resumed = run(moved, tmp_path / "run", devices[:4])
    assert "resuming at step 8" in capfd.readouterr().err
    assert [r["step"] for r in resumed] == [9]
    np.testing.assert_allclose(resumed[0]["loss"], whole[-1]["loss"], rtol=0, atol=1e-5)


def test_a_stop_on_a_local_tier_step_still_saves_it_durably(tmp_path, devices, monkeypatch):
    # A stop request after step 2, which the local tier has just saved: the durable tier
    # must get its own copy before "the checkpoint is durable" is said.
    monkeypatch.setattr(StopRequest, "should_stop", lambda self, step: step >= 2)
    cfg = small_config(**{"steps": 9, "checkpoint.every_steps": 6,
                          "checkpoint.local_dir": str(tmp_path / "local"),
                          "checkpoint.local_every_steps": 2})
    run(cfg, tmp_path / "run", devices[:1])
    durable = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()]
    assert durable == ["2"], durable
    # A stop on request is deliberate: the time until the next start will be idle, not lost.
    sessions = json.loads((tmp_path / "run" / "goodput.json").read_text())["sessions"]
    assert [s.get("clean") for s in sessions] == [True]


def test_goodput_charges_recomputed_steps_and_the_gap_to_a_restart(tmp_path):
    first = Goodput(tmp_path, started=0.0, resumed_at=0)
    first.lose("checkpoint", 2.0)
    first.training_started(now=10.0)  # 10 s in: 8 s of start-up, 2 s restoring
    first.steps(0, 10, device_s=20.0, data_s=1.0)
    first.steps(10, 20, device_s=20.0, data_s=1.0)
    row = first.summary(now=52.0)
    first.save()
    assert row["goodput"] == pytest.approx(40 / 52)
    assert row["lost_startup_s"] == 8 and row["lost_data_s"] == 2
    # The first session died after its log at 52 s, with its last checkpoint at step 15:
    # the next one starts at 60 s, resumes at 15, and steps 15..20 are done again.
    second = Goodput(tmp_path, started=60.0, resumed_at=15)
    second.training_started(now=64.0)
    second.steps(15, 20, device_s=10.0, data_s=0.0)
    row = second.summary(now=80.0)
    assert row["lost_recomputed_s"] == pytest.approx(10.0)  # half of the 10..20 interval
    assert row["lost_restart_s"] == pytest.approx(8.0)  # 52 s -> 60 s
    assert row["goodput"] == pytest.approx((20 + 10 + 10) / 80)
    assert row["wall_s"] == 80
    assert json.loads((tmp_path / "goodput.json").read_text())["sessions"][0]["resumed_at"] == 0
    second.save()
    # A third session goes back to step 5 (say the checkpoint at 15 was damaged): steps 5..20
    # of the first session (10 s + 20 s) and all of the second's (10 s) were done in vain.
    third = Goodput(tmp_path, started=90.0, resumed_at=5)
    third.training_started(now=91.0)
    row = third.summary(now=92.0)
    assert row["lost_recomputed_s"] == pytest.approx(10.0 + 20.0 + 10.0)


def test_goodput_reports_the_gap_after_a_deliberate_stop_apart_as_idle(tmp_path):
    day = 86400.0
    first = Goodput(tmp_path, started=0.0, resumed_at=0)
    first.training_started(now=10.0)
    first.steps(0, 20, device_s=40.0, data_s=0.0)
    first.summary(now=50.0)
    first.finished(now=52.0)  # reached its steps (or Ctrl-C), the checkpoint durable
    # Resumed with more steps three days later: those days are the user's, not the job's.
    second = Goodput(tmp_path, started=52.0 + 3 * day, resumed_at=20)
    second.training_started(now=second.session["start"] + 8.0)
    second.steps(20, 30, device_s=20.0, data_s=0.0)
    row = second.summary(now=second.session["start"] + 30.0)
    assert row["idle_s"] == pytest.approx(3 * day) and row["lost_restart_s"] == 0
    assert row["wall_s"] == pytest.approx(3 * day + 82.0)
    assert row["goodput"] == pytest.approx(60.0 / 82.0)  # of the 52 s + 30 s of the sessions
    second.save()
    # The second dies after that log (no clean end): the gap after it is lost, as before.
    third = Goodput(tmp_path, started=second.session["start"] + 40.0, resumed_at=30)
    row = third.summary(now=third.session["start"] + 1.0)
    assert row["lost_restart_s"] == pytest.approx(10.0)
    assert row["idle_s"] == pytest.approx(3 * day)
