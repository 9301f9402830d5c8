"""Several local processes joined by jax.distributed (gloo) train the same numbers as one."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config", "configs/tiny.py", "--config.log_every_steps=1",
        "--config.model.num_layers=2", "--config.train.global_batch=16"]
MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
pytestmark = pytest.mark.slow


def _launch(workdir, *args, processes=2, timeout=400):
    return subprocess.run([sys.executable, "-m", "jaxtrain.commands.launch", "--processes",
                           str(processes), "--devices-per-process", str(8 // processes), "--",
                           *TINY, *args, f"--workdir={workdir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("single")
    out = _launch(workdir, *MESH, "--config.steps=6", "--config.checkpoint.every_steps=3",
                  processes=1)
    assert out.returncode == 0, out.stderr[-3000:]
    return _losses(workdir)


def test_two_processes_match_one(tmp_path, single_process):
    out = _launch(tmp_path, *MESH, "--config.steps=6", "--config.checkpoint.every_steps=3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[rank 0] jaxtrain: gpt2 2x128, chunked attention, mesh {'data': 2, 'pipeline': 1, " \
        "'fsdp': 2, 'tensor': 2} on 8 cpu devices" in out.stderr
    assert "[rank 1] jaxtrain:" not in out.stderr, "only process 0 reports"
    losses = _losses(tmp_path)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([losses[s] for s in range(1, 7)],
                               [single_process[s] for s in range(1, 7)], rtol=0, atol=1e-5)
    # The checkpoint of the 2-process run resumes in one process (8 devices, another mesh).
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    out = _launch(tmp_path, "--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.steps=6",
                  "--config.checkpoint.every_steps=3", processes=1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming at step 3" in out.stderr
    resumed = _losses(tmp_path)
    np.testing.assert_allclose([resumed[s] for s in (4, 5, 6)],
                               [single_process[s] for s in (4, 5, 6)], rtol=0, atol=1e-5)


def test_hybrid_mesh_with_data_across_processes(tmp_path, single_process):
    out = _launch(tmp_path, "--config.mesh.dcn_data=2", "--config.mesh.data=1",
                  "--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.steps=6")
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(tmp_path)
    np.testing.assert_allclose([losses[s] for s in (1, 2, 3)],
                               [single_process[s] for s in (1, 2, 3)], rtol=0, atol=1e-5)


def test_a_dead_rank_stops_the_job_quickly(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxtrain.commands.launch", "--processes", "2",
         "--devices-per-process", "4", "--", *TINY, *MESH, "--config.steps=100000",
         f"--workdir={tmp_path}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not ((tmp_path / "metrics.jsonl").exists() and _losses(tmp_path)):
            assert time.time() < deadline and launcher.poll() is None
            time.sleep(0.2)
        pattern = f"jaxtrain.main .*--workdir={tmp_path} .*--process_id=1"
        rank1 = subprocess.run(["pgrep", "-f", pattern], capture_output=True,
                               text=True).stdout.split()
        assert len(rank1) == 1
        os.kill(int(rank1[0]), signal.SIGKILL)
        killed_at = time.time()
        _, err = launcher.communicate(timeout=120)
        assert time.time() - killed_at < 60
        assert launcher.returncode != 0
        assert ("jaxtrain.launch: rank 1 failed with exit status -9; stopping the other ranks"
                in err)
    finally:  # never leave a 100000-step job behind
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
