"""The run directory: its layout (every file a run keeps in it, named here once), created
and checked before anything is written, locked while a run uses it; and the one check every
command makes of the paths it is given.

A run directory is a local path or an object-storage prefix (gs://, s3://: storage.py); the
layout is the same on both.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import socket
import sys

from jaxtrain import storage
from jaxtrain.errors import ConfigError
from jaxtrain.lease import Lease, describe_holder, now

# The layout of WORKDIR.
CHECKPOINTS = "checkpoints"  # orbax steps (checkpoint.py), manifests beside them
METRICS_FILE = "metrics.jsonl"  # the logged rows on disk (metrics_log.py)
METRICS_DIR = "metrics"  # ... and on object storage, as segment objects
CONFIG_FILE = "config.json"  # the config of the run's newest session
RECORD_FILE = "data.json"  # what the run trains on (data/record.py)
TOKENIZER_DIR = "tokenizer"  # the data's tokenizer, for generate/eval/export
GOODPUT_FILE = "goodput.json"  # sessions and lost time (train/goodput.py)
TENSORBOARD_DIR = "tensorboard"
PROFILE_DIR = "profile"  # jax.profiler traces (train/profiling.py)
RESULTS_DIR = "evals"  # downstream-task results (train/task_eval.py, eval)
QUANTIZATION_FILE = "quantization.json"  # an int8 model directory (quantize)
WANDB_RUN_FILE = "wandb_run.json"  # the W&B run a resume continues (sinks.py)
REPORT_FILE = "report.png"  # jaxtrain report
LOCK_FILE = ".lock"


def check_local_path(value, key: str) -> None:
    """ConfigError (one line, naming the flag or key) for a URL where only a local path is
    supported yet (object storage reaches these paths in a later change; taken as a local
    path, gs://b/x would become a folder named 'gs:'). Checked on the text as given, before
    anything is written."""
    name = storage.scheme_of(value)
    if name is not None:
        raise ConfigError(f"{key}={value}: {name}:// paths (object storage, URLs) are not "
                          "supported yet for this path; give a local path (a bucket mounted "
                          "with gcsfuse or s3fs is one)")


def prepare_workdir(workdir) -> None:
    """Creates the directory (a prefix needs no creating) and checks that it can be written;
    ConfigError (one line) when it cannot: the disk's reason, or the object store's
    (credentials, bucket, permission)."""
    probe = workdir / f".write_test_{socket.gethostname()}_{os.getpid()}"
    if storage.is_remote(workdir):
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except Exception as e:  # noqa: BLE001 - each client raises its own
            raise storage.user_error(e, "--workdir", workdir) or ConfigError(
                f"--workdir={workdir} cannot be written: {storage.first_line(e)}") from None
        return
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--workdir={workdir} is not writable: {e.strerror}") from None


def workdir_lock(workdir, say=print):
    """The lock of a run directory: flock on disk, a lease object on object storage."""
    return Lease(workdir, say) if storage.is_remote(workdir) else WorkdirLock(workdir, say)


class WorkdirLock:
    """An exclusive lock on a run directory for as long as a run uses it.

    An advisory lock (flock) on WORKDIR/.lock, which the kernel releases when the holding
    process dies however it dies, so a lock left by a dead run is simply taken over; the
    file says who holds it (host, pid, since when) for the one-line refusal. On a network
    file system flock is only as good as the server's lock support (NFSv4 and Lustre have
    it). A multi-process job takes it in process 0 only.
    """

    def __init__(self, workdir: pathlib.Path, say=print):
        self.path = workdir / LOCK_FILE
        self.say = say
        self.handle = None

    def acquire(self) -> None:
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(self.path)
            handle.close()
            raise ConfigError(f"--workdir={self.path.parent} is in use by {holder} "
                              f"({self.path}); wait for that run to end or stop it, or use "
                              "another --workdir") from None
        left = _read(handle)
        if left:
            self.say(f"jaxtrain: taking over the lock of {describe_holder(left)}, which is no "
                     "longer running")
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": now(), "argv": sys.argv}) + "\n")
        handle.flush()
        self.handle = handle

    def release(self) -> None:
        if self.handle is None:
            return
        self.handle.seek(0)
        self.handle.truncate()  # an empty file: released cleanly
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()
        self.handle = None

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()



def _read(handle) -> dict:
    handle.seek(0)
    try:
        return json.loads(handle.read() or "{}")
    except ValueError:
        return {}



def _holder(path: pathlib.Path) -> str:
    try:
        return describe_holder(json.loads(path.read_text() or "{}"))
    except (OSError, ValueError):
        return "another process"


def write_config(workdir: pathlib.Path, cfg) -> None:
    storage.atomic_write(workdir / CONFIG_FILE, cfg.to_json_best_effort(indent=2) + "\n")
