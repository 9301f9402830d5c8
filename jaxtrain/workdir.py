"""The run directory: created and checked before anything is written, locked while a run
uses it, and the files the loop keeps in it besides checkpoints (config.json; the metrics
log is metrics_log.py's); and the one check every command makes of the paths it is given."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import pathlib
import re
import socket
import sys

from jaxtrain.errors import ConfigError

LOCK_FILE = ".lock"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_local_path(value, key: str) -> None:
    """ConfigError (one line, naming the flag or key) for a URL such as gs://bucket/run.

    Object storage is not supported yet, and taken as a local path a URL would become a
    folder named 'gs:' holding the run. Every command checks every path it is given with
    this, on the text as given (pathlib would fold the '//' away), before writing anything.
    """
    match = _URL.match(str(value))
    if match:
        raise ConfigError(f"{key}={value}: {match.group(1)}:// paths (object storage, URLs) "
                          "are not supported yet; give a local path (a bucket mounted with "
                          "gcsfuse or s3fs is one)")


def prepare_workdir(workdir: pathlib.Path) -> None:
    """Creates the directory; ConfigError (one line) when it cannot be written."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--workdir={workdir} is not writable: {e.strerror}") from None


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
            self.say(f"jaxtrain: taking over the lock of {_describe(left)}, which is no "
                     "longer running")
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": _now(), "argv": sys.argv}) + "\n")
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


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _read(handle) -> dict:
    handle.seek(0)
    try:
        return json.loads(handle.read() or "{}")
    except ValueError:
        return {}


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since "
            f"{holder.get('since', '?')}")


def _holder(path: pathlib.Path) -> str:
    try:
        return _describe(json.loads(path.read_text() or "{}"))
    except (OSError, ValueError):
        return "another process"


def write_config(workdir: pathlib.Path, cfg) -> None:
    (workdir / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")
