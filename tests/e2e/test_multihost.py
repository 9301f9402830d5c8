"""Several local processes joined by jax.distributed (gloo) train the same numbers as one."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxtrain.xla_flags import with_device_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--config", "configs/tiny.py", "--config.log_every_steps=1",
        "--config.model.num_layers=2", "--config.train.global_batch=16"]
MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
pytestmark = pytest.mark.slow


def _launch(workdir, *args, processes=2, timeout=400):
    return subprocess.run([sys.executable, "-m", "jaxtrain.commands.launch", "--processes",
                           str(processes), "--devices-per-process", str(8 // processes), "--",
                           *TINY, *args, f"--workdir={workdir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


class _Logged(dict):
    """{step: loss}, and `val`: {step: val_loss}."""
    val: dict


def _losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    logged = _Logged({r["step"]: r["loss"] for r in rows if "loss" in r})
    logged.val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    return logged


RUN = ["--config.steps=12", "--config.checkpoint.every_steps=4"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("single")
    out = _launch(workdir, *MESH, *RUN, processes=1)
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(workdir)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """An uninterrupted 2-process run: its workdir, stderr and losses."""
    workdir = tmp_path_factory.mktemp("two")
    out = _launch(workdir, *MESH, *RUN)
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir, out.stderr, _losses(workdir)


def test_two_processes_match_one(tmp_path, single_process, two_processes):
    workdir, stderr, losses = two_processes
    shutil.copytree(workdir, tmp_path, dirs_exist_ok=True)
    out = subprocess.CompletedProcess([], 0, "", stderr)
    assert "[rank 0] jaxtrain: gpt2 2x128, chunked attention, mesh {'data': 2, 'pipeline': 1, " \
        "'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 2} on 8 cpu devices" in out.stderr
    assert "[rank 1] jaxtrain:" not in out.stderr, "only process 0 reports"
    assert sorted(losses) == list(range(1, 13))
    np.testing.assert_allclose([losses[s] for s in range(1, 13)],
                               [single_process[s] for s in range(1, 13)], rtol=0, atol=1e-5)
    # Each process evaluates its own slice of the validation rows: the same val_loss.
    assert losses.val and sorted(losses.val) == sorted(single_process.val)
    np.testing.assert_allclose([losses.val[s] for s in sorted(losses.val)],
                               [single_process.val[s] for s in sorted(losses.val)],
                               rtol=0, atol=1e-5)
    # The checkpoint of the 2-process run resumes in one process (8 devices, another mesh).
    shutil.rmtree(tmp_path / "checkpoints" / "12")
    out = _launch(tmp_path, "--config.mesh.data=1", "--config.mesh.fsdp=8", *RUN, processes=1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming at step 8" in out.stderr
    resumed = _losses(tmp_path)
    np.testing.assert_allclose([resumed[s] for s in range(9, 13)],
                               [single_process[s] for s in range(9, 13)], rtol=0, atol=1e-5)


def test_hybrid_mesh_with_data_across_processes(tmp_path, single_process):
    out = _launch(tmp_path, "--config.mesh.dcn_data=2", "--config.mesh.data=1",
                  "--config.mesh.fsdp=2", "--config.mesh.tensor=2", *RUN)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(tmp_path)
    np.testing.assert_allclose([losses[s] for s in (1, 2, 3)],
                               [single_process[s] for s in (1, 2, 3)], rtol=0, atol=1e-5)


def _rank_pid(workdir, rank: int) -> int:
    pattern = f"jaxtrain.main .*--workdir={workdir} .*--process_id={rank}"
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, pids
    return int(pids[0])


def _wait(condition, process, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.05)


def _kill_rank_1_and_restart(workdir, ready, env=None) -> str:
    """A 2-process job with --max-restarts 1 whose rank 1 is killed once ready() holds: the
    launcher must stop the other rank within a minute, restart the job, and it must finish.
    Returns the launcher's stderr."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxtrain.commands.launch", "--processes", "2",
         "--devices-per-process", "4", "--max-restarts", "1", "--", *TINY, *MESH, *RUN,
         f"--workdir={workdir}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    said = []  # (when, line): when the launcher noticed the death matters, not just that
    reader = threading.Thread(target=lambda: said.extend(
        (time.time(), line) for line in launcher.stderr), daemon=True)
    reader.start()
    try:
        _wait(ready, launcher)
        os.kill(_rank_pid(workdir, 1), signal.SIGKILL)
        killed_at = time.time()
        launcher.wait(timeout=600)
        reader.join(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    err = "".join(line for _, line in said)
    assert launcher.returncode == 0, err[-3000:]
    assert "jaxtrain.launch: rank 1 failed with exit status -9; stopping the other ranks" in err
    restarted = next(when for when, line in said if "restarting the job (1 of 1) after rank 1 "
                     "exited with status 137" in line)
    assert restarted - killed_at < 60, "a dead rank must not leave the job hanging"
    assert "resuming at step" in err
    return err


def test_a_killed_rank_is_restarted_and_the_job_trains_the_same_numbers(tmp_path,
                                                                        two_processes):
    _kill_rank_1_and_restart(tmp_path, lambda: (
        (tmp_path / "checkpoint_manifests" / "4.json").exists()
        and max(_losses(tmp_path), default=0) >= 5))
    assert _losses(tmp_path) == two_processes[2], "every step's loss, bit for bit"
    last = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["lost_restart_s"] > 0 and 0 < last["goodput"] < 1


def test_without_a_launcher_a_rank_whose_peer_died_exits_in_bounded_time(tmp_path):
    """No supervisor: jax.distributed's heartbeat (distributed.heartbeat_timeout_s) ends the
    survivor, non-zero, so that a scheduler can restart the job."""
    port = subprocess.run([sys.executable, "-c", "import socket; s = socket.socket(); "
                           "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"],
                          capture_output=True, text=True).stdout.strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=with_device_count(4))
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "jaxtrain.main", *TINY, *MESH, "--config.steps=100000",
         "--config.distributed.heartbeat_timeout_s=10", f"--workdir={tmp_path}",
         f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={rank}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for rank in range(2)]
    try:
        _wait(lambda: (tmp_path / "metrics.jsonl").exists() and _losses(tmp_path), ranks[0])
        ranks[1].kill()
        killed_at = time.time()
        ranks[0].wait(timeout=120)
        detected = time.time() - killed_at
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert ranks[0].returncode != 0
    assert detected < 60, detected
    assert "another task died" in ranks[0].stderr.read()


def test_a_job_with_no_shared_directory_resumes_bitwise_after_a_dead_rank(tmp_path,
                                                                       two_processes):
    """The object store (the GCS emulator) is all the two processes share: each writes its
    own shards of every checkpoint straight to the bucket, process 0 the marker last. Rank 1
    dies after a checkpoint, the job restarts, every rank reads its own shards in place, and
    the losses are those of the uninterrupted run on a shared disk."""
    from conftest import object_server

    from jaxtrain import storage
    from jaxtrain.metrics_log import read_metrics

    server = object_server("gs")
    workdir = server.bucket() + "/run"
    fs, root = storage.filesystem(workdir)
    env = dict(os.environ, **server.env(), JAXTRAIN_SCRATCH=str(tmp_path / "scratch"))

    def committed() -> bool:
        fs.invalidate_cache()
        return fs.exists(f"{root}/checkpoints/4/commit.json")
    _kill_rank_1_and_restart(workdir, committed, env)
    rows = read_metrics(storage.as_path(workdir), say=lambda _: None)
    assert {r["step"]: r["loss"] for r in rows if "loss" in r} == two_processes[2], \
        "every step's loss, bit for bit, each row once"
    staged = [p for p in (tmp_path / "scratch").rglob("*")
              if p.is_file() and "checkpoint" in str(p.relative_to(tmp_path))]
    assert staged == [], "in place: nothing of a checkpoint on a host's disk"
    objects = sorted(storage.listing(f"{workdir}/checkpoints/12"))
    assert objects == ["commit.json", "state.p0.0.bin", "state.p0.json", "state.p1.0.bin",
                       "state.p1.json"], "2 objects per process and the marker"
