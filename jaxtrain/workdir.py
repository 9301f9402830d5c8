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

from jaxtrain import retry, storage
from jaxtrain.errors import ConfigError, WorkdirBusy
from jaxtrain.lease import Held, Lease, describe_holder, now

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
MANIFESTS_DIR = "checkpoint_manifests"  # the local tier's step manifests (checkpoint_local.py)

# What only a run writes: a folder holding one of these is a run directory. (config.json and
# tokenizer/ are not marks: a Hugging Face model folder and a prepared dataset hold them.)
RUN_MARKS = (CHECKPOINTS, MANIFESTS_DIR, RECORD_FILE, METRICS_FILE, METRICS_DIR, GOODPUT_FILE,
             TENSORBOARD_DIR, WANDB_RUN_FILE, QUANTIZATION_FILE)
DATASET_MANIFEST = "manifest.json"  # a prepared dataset's (data/dataset.py MANIFEST)


# The one check of a path flag that takes only a local path (storage.py; config and the
# commands import it from here).
check_local_path = storage.check_local_path


def prepare_workdir(workdir) -> None:
    """Creates the directory (a prefix needs no creating) and checks that it can be written
    and is a run's (check_run_folder); ConfigError (one line) when it cannot: the disk's
    reason, or the object store's (credentials, bucket, permission)."""
    retry.budget_s(), retry.stall_s()  # a bad $JAXTRAIN_STORAGE_* is one line, up front
    storage.require_writable(workdir, "--workdir")
    check_run_folder(workdir)


def folder_names(directory) -> list[str]:
    """The names in a local directory or under a prefix (none when there is none), less
    hidden ones (a lock, another process's write probe, a file manager's)."""
    return sorted(n for n in storage.names(directory) if n and not n.startswith("."))


def check_new_folder(directory, key: str) -> None:
    """ConfigError (one line, naming `key`) unless `directory` is a new or empty folder this
    process can write (on object storage: its bucket exists and takes a write, and nothing
    is under the prefix), checked before any work: an export would mix its files with, or
    overwrite, whatever is there."""
    held = storage.new_folder_contents(directory, key)
    if held:
        names = sorted(held)
        raise ConfigError(f"{key}={directory} is not empty (it holds {', '.join(names[:3])}"
                          f"{' and more' if len(names) > 3 else ''}); export into a new or "
                          "empty folder")


def check_run_folder(workdir) -> None:
    """ConfigError (one line) for a folder that is not a run's: a prepared dataset, or one
    that holds files but none that only a run writes (RUN_MARKS). A run writes its
    tokenizer, config and metrics there, which would overwrite what the folder holds."""
    names = folder_names(workdir)
    use = "give a new or empty folder, or an existing run's"
    if DATASET_MANIFEST in names:
        raise ConfigError(f"--workdir={workdir} holds a prepared dataset ({DATASET_MANIFEST}), "
                          f"not a run: a run would overwrite its tokenizer/; {use}")
    if names and not set(names) & set(RUN_MARKS):
        shown = ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3
                                        else "")
        raise ConfigError(f"--workdir={workdir} is not a run directory: it holds {shown} and "
                          f"none of a run's files ({', '.join(RUN_MARKS[:4])}, ...); {use}")


def workdir_lock(workdir, say=print):
    """The lock of a run directory: flock on disk, a lease object on object storage."""
    return WorkdirLock(workdir, say) if storage.on_disk(workdir) else Lease(workdir, say)


class WorkdirLock(Held):
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
            raise WorkdirBusy(f"--workdir={self.path.parent} is in use by {holder} "
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


def config_text(cfg) -> str:
    """WORKDIR/config.json's content: the resolved config."""
    return cfg.to_json_best_effort(indent=2) + "\n"


def write_config(workdir: pathlib.Path, cfg) -> None:
    storage.atomic_write(workdir / CONFIG_FILE, config_text(cfg))
