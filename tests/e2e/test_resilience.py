"""Nothing is lost: exact resume after kill -9 and SIGTERM, damaged checkpoints, resharding,
non-finite steps, and bad input."""

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import small_config
from helpers import train_steps

from jaxtrain.checkpoint import Checkpoints
from jaxtrain.commands import report
from jaxtrain.config import ConfigError, apply_overrides, load_config_file
from jaxtrain.optim import skipped_steps
from jaxtrain.train.loop import TrainingStopped, run
from jaxtrain.train.setup import build
from jaxtrain.xla_flags import with_device_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A quick run of the tiny config through the CLI: 24 steps, checkpoints every 6.
CLI_OVERRIDES = ["--config.steps=24", "--config.checkpoint.every_steps=6",
                 "--config.log_every_steps=1", "--config.eval_every_steps=12",
                 "--config.model.d_model=64", "--config.model.num_layers=2",
                 "--config.model.seq_len=64", "--config.train.global_batch=16"]


def _cli_config():
    """The config the CLI runs: configs/tiny.py with CLI_OVERRIDES."""
    overrides = dict(arg[len("--config."):].split("=") for arg in CLI_OVERRIDES)
    return apply_overrides(load_config_file(ROOT / "configs" / "tiny.py"),
                           {key: int(value) for key, value in overrides.items()})


def _start(workdir):
    env = dict(os.environ, XLA_FLAGS=with_device_count(1))
    return subprocess.Popen([sys.executable, "-m", "jaxtrain.main", "--config",
                             "configs/tiny.py", *CLI_OVERRIDES, f"--workdir={workdir}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _wait_for_step(workdir, step, process, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        path = workdir / "metrics.jsonl"
        if path.exists() and max(_losses(workdir), default=0) >= step:
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} never logged")


def _wait_for_a_checkpoint(workdir, process, timeout=240):
    """Until some step's checkpoint is committed (orbax renames a finished step's directory
    to the bare step number): saves are asynchronous, so a kill right after step 7 is
    logged can come before step 6's save is on disk, and the rerun then rightly starts over."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        directory = workdir / "checkpoints"
        if directory.exists() and any(p.name.isdigit() for p in directory.iterdir()):
            return
        time.sleep(0.05)
    raise TimeoutError("no checkpoint was committed")


def _final_params(workdir, step=24):
    cfg = _cli_config()
    setup = build(cfg, jax.devices()[:1])
    checkpoints = Checkpoints(workdir / "checkpoints", keep=3)
    tree = checkpoints.restore(step, setup.abstract_state().tree())
    checkpoints.close()
    return jax.tree.map(np.asarray, tree["params"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    process = _start(workdir)
    _, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-2000:]
    return _losses(workdir), _final_params(workdir)


def _assert_same_run(workdir, uninterrupted):
    losses, params = uninterrupted
    assert _losses(workdir) == losses, "every step's loss, bit for bit"
    for a, b in zip(jax.tree.leaves(_final_params(workdir)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_kill_9_then_rerun_is_bitwise_the_same_run(tmp_path, uninterrupted):
    kill_after = random.Random().randint(7, 20)
    process = _start(tmp_path)
    _wait_for_step(tmp_path, kill_after, process)
    _wait_for_a_checkpoint(tmp_path, process)
    process.kill()
    process.wait()
    assert max(_losses(tmp_path)) < 24, "killed before the end"
    rerun = _start(tmp_path)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-2000:]
    assert "resuming at step" in err
    _assert_same_run(tmp_path, uninterrupted)
    # Goodput accounts for the restart: the steps run past the checkpoint were done twice,
    # and the time between the kill and the rerun is lost.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["lost_recomputed_s"] > 0 and last["lost_restart_s"] > 0
    lost = sum(v for k, v in last.items() if k.startswith("lost_"))
    assert 0 < last["goodput"] < 1
    assert last["goodput"] * last["wall_s"] + lost <= last["wall_s"] * 1.01
    report.main(["--workdir", str(tmp_path)])
    assert (tmp_path / "report.png").stat().st_size > 10_000


@pytest.mark.slow
def test_sigterm_saves_the_step_and_exits_0(tmp_path, uninterrupted):
    process = _start(tmp_path)
    _wait_for_step(tmp_path, 8, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-2000:]
    stopped = max(_losses(tmp_path))
    assert stopped < 24
    assert f"stopped at step {stopped} on SIGTERM" in err
    assert max(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
               if p.name.isdigit()) == stopped
    rerun = _start(tmp_path)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0 and f"resuming at step {stopped}" in err, err[-2000:]
    _assert_same_run(tmp_path, uninterrupted)


def _largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, devices, capfd, damage):
    cfg = small_config(**{"steps": 6, "checkpoint.every_steps": 3})
    whole = run(cfg, tmp_path, devices[:1])
    victim = _largest_file(tmp_path / "checkpoints" / "6")
    size = victim.stat().st_size
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[: size // 2])
        expected = f"{victim} is truncated ({size // 2} of {size} bytes)"
    else:
        victim.unlink()
        expected = f"{victim} is missing"
    capfd.readouterr()
    resumed = run(cfg, tmp_path, devices[:1])
    err = capfd.readouterr().err
    assert f"jaxtrain: checkpoint step 6 in {tmp_path / 'checkpoints'} is damaged: {expected}; moved to" in err
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]
    kept = list((tmp_path / "checkpoints_damaged").iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("6-"), "set aside, not deleted"


@pytest.mark.slow
def test_restore_onto_other_meshes(tmp_path, devices):
    cfg = small_config(**{"steps": 6, "checkpoint.every_steps": 3, "mesh.data": 1,
                          "mesh.fsdp": 8})
    moved_never = run(cfg, tmp_path / "fsdp8", devices)
    saved = Checkpoints(tmp_path / "fsdp8" / "checkpoints", keep=3)
    at_3 = saved.restore(3, build(cfg, devices).abstract_state().tree())
    saved.close()
    for mesh, devs in [({"mesh.fsdp": 1, "mesh.data": 2, "mesh.tensor": 4}, devices),
                       ({"mesh.fsdp": 1, "mesh.data": 4}, devices[:4])]:
        other = small_config(**{"steps": 6, "checkpoint.every_steps": 3, **mesh})
        workdir = tmp_path / f"moved{len(devs)}"
        checkpoints = Checkpoints(tmp_path / "fsdp8" / "checkpoints", keep=3)
        restored = checkpoints.restore(3, build(other, devs).abstract_state().tree())
        checkpoints.close()
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(at_3)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert restored["params"]["tok_embed"].sharding.mesh.devices.size == len(devs)
        # Continue on the new mesh from step 3: the same numbers as never moving.
        shutil.copytree(tmp_path / "fsdp8" / "checkpoints", workdir / "checkpoints")
        shutil.rmtree(workdir / "checkpoints" / "6")
        rows = run(other, workdir, devs)
        assert [r["step"] for r in rows] == [4, 5, 6]
        np.testing.assert_allclose([r["loss"] for r in rows],
                                   [r["loss"] for r in moved_never[3:]], rtol=0, atol=1e-5)


def test_a_non_finite_step_is_skipped_and_counted(devices):
    cfg = small_config(**{"steps": 4, "debug.nan_from_step": 2})
    clean_losses, params_after_2, _ = train_steps(small_config(steps=4), devices[:1], steps=2)
    losses, params, state = train_steps(cfg, devices[:1], steps=3)
    assert losses[:2] == clean_losses and np.isnan(losses[2])
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_after_2)):
        np.testing.assert_array_equal(a, b)  # the bad step changed nothing
    assert int(skipped_steps(state.opt_state)[0]) == 1
    assert int(state.step) == 3


def test_k_bad_steps_in_a_row_stop_the_run_with_a_checkpoint(tmp_path, devices):
    cfg = small_config(**{"steps": 20, "debug.nan_from_step": 2, "debug.nan_steps": 100,
                          "train.max_consecutive_bad_steps": 3})
    with pytest.raises(TrainingStopped, match=r"3 non-finite steps in a row up to step 5 "
                       r"\(train.max_consecutive_bad_steps=3\); no update was applied"):
        run(cfg, tmp_path, devices[:1])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows if "loss" in r][:5] == [0, 0, 1, 2, 3]
    saved = Checkpoints(tmp_path / "checkpoints", keep=3)
    step = saved.steps()[-1]
    tree = saved.restore(step, build(cfg, devices[:1]).abstract_state().tree())
    saved.close()
    _, params_after_2, _ = train_steps(cfg, devices[:1], steps=2)
    for a, b in zip(jax.tree.leaves(tree["params"]), jax.tree.leaves(params_after_2)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_workdir_of_another_model_is_refused_before_writing(tmp_path, devices):
    run(small_config(steps=2), tmp_path, devices[:1])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"model.d_model=32 does not match the checkpoint at "
                       r"step 2 in .* \(model.d_model=64\); use another --workdir"):
        run(small_config(steps=4, **{"model.d_model": 32}), tmp_path, devices[:1])
    assert before == {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}


def test_an_unwritable_workdir_is_a_clear_error(tmp_path, devices):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--workdir=.*file/run is not writable"):
        run(small_config(), tmp_path / "file" / "run", devices[:1])


def test_a_stop_right_after_a_periodic_checkpoint_saves_once(tmp_path, devices, monkeypatch):
    from jaxtrain.train import preemption
    monkeypatch.setattr(preemption.StopRequest, "should_stop", lambda self, step: step == 3)
    rows = run(small_config(**{"steps": 6, "checkpoint.every_steps": 3}), tmp_path, devices[:1])
    assert rows[-1]["step"] == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
