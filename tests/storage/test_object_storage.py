"""Runs whose every path is on object storage, end to end through the CLI, against the real
servers the tests start (moto's S3 server, fake-gcs-server: tests/servers.py): a kill -9 and
a rerun on another host's empty scratch disk is bitwise the uninterrupted run; prepare,
train, export and generate with nothing on a shared disk; and the user errors, one line."""

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import object_server
from test_resilience import CLI_OVERRIDES, _cli_config

from jaxtrain import storage
from jaxtrain.checkpoint import Checkpoints
from jaxtrain.metrics_log import read_metrics
from jaxtrain.train.setup import build
from jaxtrain.xla_flags import with_device_count

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env(server, scratch: pathlib.Path) -> dict:
    """A process on its own host: its scratch disk, the server's endpoint."""
    return dict(os.environ, **server.env(), XLA_FLAGS=with_device_count(1),
                JAXTRAIN_SCRATCH=str(scratch), JAXTRAIN_HUGE_PAGES="0")


def _start(workdir: str, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxtrain.main", "--config",
                             "configs/tiny.py", *CLI_OVERRIDES, *extra, f"--workdir={workdir}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _losses(workdir) -> dict[int, float]:
    rows = read_metrics(storage.as_path(workdir), say=lambda _: None)
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _final_params(workdir, step: int = 24):
    setup = build(_cli_config(), jax.devices()[:1])
    checkpoints = Checkpoints(storage.as_path(workdir) / "checkpoints", keep=3,
                              read_only=True)
    tree = checkpoints.restore(step, setup.abstract_state().tree())
    checkpoints.close()
    return jax.tree.map(np.asarray, tree["params"])


def _committed_steps(workdir: str) -> list[int]:
    """The steps with a commit marker (checkpoint_remote.py: the marker is written last)."""
    names = storage.listing(f"{workdir}/checkpoints")
    return sorted(int(n.split("/")[0]) for n in names if n.endswith("/commit.json")
                  and n.split("/")[0].isdigit())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same run on a local disk: storage must not change a single bit."""
    workdir = tmp_path_factory.mktemp("local")
    env = dict(os.environ, XLA_FLAGS=with_device_count(1), JAXTRAIN_HUGE_PAGES="0")
    process = _start(str(workdir), env)
    _, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-2000:]
    return _losses(workdir), _final_params(workdir)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_kill_9_and_rerun_on_another_host_is_bitwise_the_same_run(scheme, tmp_path,
                                                                   uninterrupted):
    server = object_server(scheme)
    workdir = server.bucket() + "/run"
    process = _start(workdir, _env(server, tmp_path / "host-a"))
    deadline = time.time() + 300
    while not _committed_steps(workdir):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.time() < deadline, "no checkpoint was committed"
        time.sleep(0.2)
    process.kill()
    process.wait()
    assert max(_committed_steps(workdir)) < 24, "killed before the end"
    # Host b has nothing of host a's: every byte comes from the object store.
    rerun = _start(workdir, _env(server, tmp_path / "host-b"))
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-3000:]
    assert "resuming at step" in err, err[-3000:]
    losses, params = uninterrupted
    assert _losses(workdir) == losses, "every step's loss, bit for bit, each row once"
    for a, b in zip(jax.tree.leaves(_final_params(workdir)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    fs, root = storage.filesystem(workdir)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/.lock"), "the lease is released at the end"
    assert fs.exists(f"{root}/config.json") and fs.exists(f"{root}/data.json")
    assert fs.find(f"{root}/tensorboard"), "TensorBoard events uploaded"


def _jaxtrain(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_prepare_train_export_generate_with_every_path_on_object_storage(tmp_path):
    server = object_server("gs")
    bucket = server.bucket()
    env = _env(server, tmp_path / "scratch")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                              for i in range(400)))
    steps = [
        ["prepare", str(corpus), "--out", f"{bucket}/data", "--tokenizer", "bytes",
         "--no-progress"],
        ["train", "--config", "configs/tiny.py", *CLI_OVERRIDES, "--config.steps=6",
         "--config.eval_every_steps=6", "--config.data.source=prepared",
         f"--config.data.path={bucket}/data", "--workdir", f"{bucket}/run"],
        ["convert", "--to-hf", f"{bucket}/hf", "--workdir", f"{bucket}/run"],
        ["generate", "--workdir", f"{bucket}/run", "--prompt", "line 1", "--max_new_tokens",
         "8"],
    ]
    for args in steps:
        out = _jaxtrain(args, env)
        assert out.returncode == 0, (args[0], out.stderr[-3000:])
    fs, root = storage.filesystem(bucket)
    fs.invalidate_cache()
    assert fs.exists(f"{root}/hf/config.json") and fs.find(f"{root}/hf")
    config = json.loads(fs.cat_file(f"{root}/hf/config.json"))
    assert config["vocab_size"] == _cli_config().model.vocab_size
    assert not list(tmp_path.glob("gs:*")), "no local folder named after the URL"


def test_a_missing_bucket_or_credentials_is_one_line_and_exit_2(tmp_path):
    server = object_server("s3")
    env = _env(server, tmp_path / "scratch")
    no_keys = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID",
                                                         "AWS_SECRET_ACCESS_KEY")}
    no_keys.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                   AWS_CONFIG_FILE="/nonexistent")
    existing = server.bucket()
    cases = [(env, "s3://no-such-bucket-jt/run", "bucket no-such-bucket-jt does not exist"),
             (no_keys, f"{existing}/run", "no credentials for s3://")]
    for case_env, workdir, message in cases:
        out = _jaxtrain(["train", "--config", "configs/tiny.py", "--workdir", workdir],
                        case_env, timeout=300)
        assert out.returncode == 2, out.stderr[-2000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"jaxtrain: error: --workdir={workdir}: {message}"), lines


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_missing_bucket_is_named_in_one_line_on_either_store(scheme):
    from jaxtrain.errors import ConfigError
    from jaxtrain.workdir import check_new_folder, prepare_workdir

    object_server(scheme)
    url = f"{scheme}://no-such-bucket-jt/run"
    for check, key in ((prepare_workdir, "--workdir"),
                       (lambda p: check_new_folder(p, "--to-hf"), "--to-hf")):
        with pytest.raises(ConfigError) as error:
            check(storage.as_path(url))
        assert str(error.value) == f"{key}={url}: bucket no-such-bucket-jt does not exist"


def test_an_upper_case_scheme_is_the_same_store(bucket):
    from jaxtrain.lease import Lease
    from jaxtrain.workdir import prepare_workdir

    name = bucket.split("://", 1)[1]
    upper = f"{bucket.split('://')[0].upper()}://{name}/run"  # S3://... as a user may type it
    storage.check_path(upper, "--workdir")
    path = storage.as_path(upper, "--workdir")
    assert str(path) == f"{bucket}/run"
    prepare_workdir(path)
    with Lease(upper) as lease:
        assert json.loads(storage.as_path(f"{bucket}/run/.lock").read_text())["id"] == lease.id


def _fresh_s3_clients() -> None:
    """Forgets the s3 clients made so far (fsspec's instances and epath's cache of them), so
    that the next one reads the endpoint from the environment."""
    import s3fs
    from etils.epath import backend

    s3fs.S3FileSystem.clear_instance_cache()
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()


def test_a_key_the_server_does_not_know_is_invalid_credentials(monkeypatch):
    from servers import S3Server

    from jaxtrain.errors import ConfigError
    from jaxtrain.workdir import prepare_workdir

    # moto checks keys when its IAM auth is on: the one request it lets through unchecked
    # makes the bucket; every later one with the unknown key "testing" is refused.
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "1")
    server = S3Server()
    try:
        workdir = server.bucket() + "/run"
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        _fresh_s3_clients()
        with pytest.raises(ConfigError) as error:
            prepare_workdir(storage.as_path(workdir))
    finally:
        monkeypatch.undo()  # the shared server's endpoint again, for the next clients
        _fresh_s3_clients()
        server.stop()
    assert str(error.value) == (
        f"--workdir={workdir}: invalid credentials for s3:// (the server does not accept the "
        f"key in use: {storage.SCHEMES['s3'].credentials})")


def test_gcs_401_is_invalid_credentials_and_an_anonymous_401_no_credentials():
    from gcsfs.retry import HttpError

    bad = HttpError({"code": 401, "message": "Invalid Credentials"})
    anonymous = HttpError({"code": 401, "message": "Anonymous caller does not have "
                           "storage.objects.create access to the Google Cloud Storage object."})
    assert str(storage.user_error(bad, "--workdir", "gs://b/run")).startswith(
        "--workdir=gs://b/run: invalid credentials for gs:// (the server does not accept")
    assert str(storage.user_error(anonymous, "--workdir", "gs://b/run")).startswith(
        "--workdir=gs://b/run: no credentials for gs://")


@pytest.mark.slow
def test_an_export_to_a_missing_bucket_is_refused_before_any_work(tmp_path):
    from helpers import run_commands

    object_server("s3")
    object_server("gs")
    (tmp_path / "run").mkdir()  # no run: the destination is checked before it is read
    argvs = [["convert", "--to-hf", f"{scheme}://no-such-bucket-jt/hf", "--workdir", "run"]
             for scheme in ("s3", "gs")]
    for argv, (code, _, err) in zip(argvs, run_commands(argvs, tmp_path)):
        assert code == 2, err[-2000:]
        assert err.strip().splitlines() == [
            f"jaxtrain: error: --to-hf={argv[2]}: bucket no-such-bucket-jt does not exist"]


# -- a store that stops answering (SIGSTOP of the S3 server) ------------------------------

# The pauses of 150 s and 200 s against a 120 s retry budget and a 300 s takeover
# time, scaled down: a 2 s budget, a 6 s takeover time (heartbeat 0.5 s), a report every
# 0.5 s. 4.5 s outlasts the budget twice over wherever it falls (the 150 s pause killed the
# run where a write of the training thread met it whole) and stays within the takeover time;
# 8 s also outlasts the takeover time (the 200 s pauses left the lease unconfirmed for 315 s).
_SCALED = {"JAXTRAIN_STORAGE_RETRY_S": "2", "JAXTRAIN_STORAGE_STALL_S": "0.5",
           "JAXTRAIN_LEASE_HEARTBEAT_S": "0.5", "JAXTRAIN_LEASE_STALE_S": "6"}


def _read_all(stream, into: list) -> None:
    for chunk in iter(lambda: stream.read(256), ""):
        into.append(chunk)


@pytest.mark.slow
@pytest.mark.parametrize("pause_s", [4.5, 8.0], ids=["past_the_retry_budget",
                                                     "past_the_takeover_time"])
@pytest.mark.parametrize("from_step", [6, 18], ids=["mid_run", "across_the_last_step"])
def test_a_paused_store_costs_no_step_and_no_row(tmp_path, uninterrupted, pause_s, from_step):
    """The S3 server is paused (SIGSTOP) once the checkpoint of `from_step` is committed: at
    step 6 of 24 the run trains on through the pause, and from step 18 the pause also spans
    the last step, its checkpoint and the run's last writes. Either way the run finishes
    (exit 0), says "still trying" while it waits, keeps its lease, and its rows and final
    parameters are bit for bit the uninterrupted run's."""
    server = object_server("s3")
    workdir = server.bucket() + "/run"
    env = dict(_env(server, tmp_path / "host"), **_SCALED)
    process = _start(workdir, env)
    err: list[str] = []
    reader = threading.Thread(target=_read_all, args=(process.stderr, err), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while from_step not in _committed_steps(workdir):
        assert process.poll() is None, "".join(err)[-3000:]
        assert time.time() < deadline, "no checkpoint was committed"
        time.sleep(0.05)
    server.pause()
    try:
        time.sleep(pause_s)
    finally:
        server.resume()
    process.wait(timeout=600)
    reader.join(30)
    said = "".join(err)
    assert process.returncode == 0, said[-3000:]
    assert "the store has not answered for" in said and "still trying" in said, said[-3000:]
    assert "lost the lease" not in said, said[-3000:]
    losses, params = uninterrupted
    assert _losses(workdir) == losses, "every step's loss, bit for bit, each row once"
    assert max(_committed_steps(workdir)) == 24, said[-3000:]
    for a, b in zip(jax.tree.leaves(_final_params(workdir)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    fs, root = storage.filesystem(workdir)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/.lock"), "the lease is released at the end"
    assert json.loads(fs.cat_file(f"{root}/goodput.json"))["sessions"][-1].get("clean")
