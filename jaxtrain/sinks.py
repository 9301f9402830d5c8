"""Where logged metrics go, one registry entry per name in `metrics.sinks`: metrics.jsonl
(always: resume, `jaxtrain report` and the tests read it), TensorBoard, Weights & Biases.

A sink is opened once per run on process 0 with the run's workdir, config and first step,
receives every row the run logs (`write(step, row)`), and is closed at the end. Adding one
(MLflow, a database) is one `MetricSink` entry here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import netrc
import os
import pathlib
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import Protocol

from jaxtrain import storage
from jaxtrain.errors import ConfigError, fail, require_package
from jaxtrain.metrics_log import MetricsLog
from jaxtrain.outbox import Job, Outbox
from jaxtrain.workdir import TENSORBOARD_DIR, WANDB_RUN_FILE

WANDB_MODES = ("online", "offline", "disabled")


class Sink(Protocol):
    """Also, optionally, flush(): make the rows written so far durable, or start to, without
    waiting on a remote store (the loop calls it before each checkpoint save, so a resume
    finds the rows up to its step); and sync(timeout): wait for what flush started."""

    def write(self, step: int, row: dict) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """The run's metrics log (metrics_log.py: WORKDIR/metrics.jsonl, or segments on object
    storage): one JSON object per row, floats exactly as Python holds them."""

    def __init__(self, workdir: pathlib.Path, cfg, start_step: int, outbox=None):
        self.log = MetricsLog(workdir, outbox=outbox)

    def write(self, step: int, row: dict) -> None:
        self.log.write({"step": int(step), **row})

    def flush(self) -> None:
        self.log.flush()  # hands the rows to the log's writer thread; sync() waits for them

    def sync(self, timeout: float | None = None) -> bool:
        return self.log.sync(timeout)

    def close(self) -> None:
        self.log.close()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _summary_writer():
    """tensorboardX's SummaryWriter, imported only where it writes, and without torch:
    tensorboardX imports torch when it can (to accept its tensors; we write floats), which
    cost a CLI start 1.7 s on a machine with torch installed."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardSink:
    """WORKDIR/tensorboard: a scalar per key (non-finite values, and text such as the
    session's peak_source, are left out)."""

    PUBLISH_S = 120.0

    def __init__(self, workdir: pathlib.Path, cfg, start_step: int, outbox=None):
        SummaryWriter = _summary_writer()
        target = workdir / TENSORBOARD_DIR
        # Event files are appended to, which an object store cannot do: on gs:// or s3://
        # they are written to this host's scratch disk and uploaded whole by the outbox's
        # thread, at most every PUBLISH_S and at the end (one PUT per event file each time).
        self.output = storage.LocalMirror(target, "tensorboard")
        self.outbox = outbox or Outbox(workdir, _say)
        self.owns = outbox is None
        self.published = time.monotonic()
        self.writer = SummaryWriter(str(self.output.path))

    def write(self, step: int, row: dict) -> None:
        for key, value in row.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        if self.output.staged and time.monotonic() - self.published > self.PUBLISH_S:
            self._publish()

    def _publish(self) -> None:
        self.writer.flush()
        if self.output.staged:  # the folder as it is when the job runs: the newest wins
            self.outbox.submit(Job(self.output.sync, "TensorBoard's event files",
                                   str(self.output.target), lambda _: str(self.output.path),
                                   key=str(self.output.target)))
        self.published = time.monotonic()

    def close(self) -> None:
        self.writer.close()
        self._publish()
        if self.owns:
            self.outbox.close()


class WandbSink:
    """A Weights & Biases run in WORKDIR/wandb, with the run's config attached. Its id is kept
    in WORKDIR/wandb_run.json, so a resumed run (start_step > 0) logs into the same W&B run;
    a run that starts at step 0 starts a new one, as metrics.jsonl starts afresh."""

    def __init__(self, workdir: pathlib.Path, cfg, start_step: int):
        import wandb  # heavy, optional (the [wandb] extra)

        w = cfg.metrics.wandb
        stored = workdir / WANDB_RUN_FILE
        run_id = _stored_id(stored) if start_step > 0 else None
        try:
            self.run = wandb.init(
                project=w.project or None, entity=w.entity or None,
                name=w.run_name or workdir.resolve().name, mode=w.mode, dir=str(workdir),
                id=run_id, resume="allow", config=cfg.to_dict(), allow_val_change=True)
        except wandb.errors.Error as e:  # no login, no network, a refused project, ...
            message = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(f"metrics.sinks={cfg.metrics.sinks!r}: W&B could not start a "
                              f"run ({message}); `wandb login`, or set "
                              "metrics.wandb.mode=offline") from None
        storage.write_json(stored, {"id": self.run.id, "project": w.project,
                                    "entity": w.entity})

    def write(self, step: int, row: dict) -> None:
        self.run.log(dict(row), step=int(step))

    def close(self) -> None:
        self.run.finish()


def _stored_id(path: pathlib.Path) -> str | None:
    try:
        return json.loads(path.read_text())["id"]
    except (OSError, ValueError, KeyError):
        return None


def _check_wandb(c) -> None:
    if c.metrics.wandb.mode not in WANDB_MODES:
        fail("metrics.wandb.mode", c.metrics.wandb.mode,
             f"valid values are {', '.join(WANDB_MODES)}")
    if c.metrics.wandb.mode == "online" and not _wandb_credentials():
        # Else wandb.init waits ~25 s for a login that never comes, after the run has
        # written its workdir.
        raise ConfigError(f"metrics.sinks={c.metrics.sinks!r}: W&B online mode needs an API "
                          "key and none is set (WANDB_API_KEY, or `wandb login`, which writes "
                          "~/.netrc); or set metrics.wandb.mode=offline (no key needed)")


def _wandb_credentials() -> bool:
    """Whether W&B will find credentials where it looks first (its environment variables,
    or the netrc entry of its server, as `wandb login` writes it), without importing it."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL")
                                 or "https://api.wandb.ai").hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


@dataclasses.dataclass(frozen=True)
class MetricSink:
    """One `metrics.sinks` name: what opens it, the package it runs on, its config checks."""

    name: str
    doc: str
    open: Callable  # (workdir, config, start step[, outbox=]) -> Sink
    check: Callable | None = None  # config -> None, raising ConfigError
    module: str | None = None  # the package it imports when opened; None: none
    # Whether it writes to the workdir itself, through the run's outbox (outbox.py), which
    # `open` then takes as `outbox=`.
    writes_workdir: bool = False

    def validate(self, c) -> None:
        if self.module is not None:
            require_package(self.module, f"metrics.sinks={c.metrics.sinks!r}: the {self.name} "
                            "sink")
        if self.check is not None:
            self.check(c)


SINKS: dict[str, MetricSink] = {s.name: s for s in (
    MetricSink("jsonl", "WORKDIR/metrics.jsonl (always on)", JsonlSink, writes_workdir=True),
    MetricSink("tensorboard", "WORKDIR/tensorboard event files", TensorBoardSink,
               module="tensorboardX", writes_workdir=True),
    MetricSink("wandb", "Weights & Biases (metrics.wandb.*; offline mode needs no network)",
               WandbSink, _check_wandb, module="wandb"),
)}
REQUIRED_SINKS = ("jsonl",)


def defaults() -> dict:
    """The `metrics` section of config.base_config(): where logged metrics go
    (metrics.jsonl always)."""
    return {
        "sinks": "jsonl,tensorboard",  # add wandb for Weights & Biases
        "wandb": {
            "project": "jaxtrain",
            "entity": "",  # "": the account's default
            "run_name": "",  # "": the workdir's name
            "mode": "online",  # offline: no network (`wandb sync` later); disabled
        },
    }


def sink_names(c) -> tuple[str, ...]:
    """metrics.sinks as names: 'jsonl, tensorboard' -> ('jsonl', 'tensorboard')."""
    return tuple(dict.fromkeys(n.strip() for n in str(c.metrics.sinks).split(",") if n.strip()))


def validate_sinks(c) -> None:
    names = sink_names(c)
    for name in names:
        if name not in SINKS:
            fail("metrics.sinks", c.metrics.sinks, f"{name!r} is no sink; valid values are "
                 f"comma-separated names of {', '.join(SINKS)}")
    for name in REQUIRED_SINKS:
        if name not in names:
            fail("metrics.sinks", c.metrics.sinks, f"must include {name} (resume and "
                 "`jaxtrain report` read it)")
    for name in names:
        SINKS[name].validate(c)


def open_sinks(workdir: pathlib.Path, cfg, start_step: int, names,
               outbox: Outbox | None = None) -> list[Sink]:
    """The sinks of `names`, opened (all or none: one that fails closes the others); those
    that write to a remote workdir hand their writes to `outbox` (the run's writer thread;
    None: each its own)."""
    opened: list[Sink] = []
    try:
        for name in names:
            entry = SINKS[name]
            extra = {"outbox": outbox} if entry.writes_workdir else {}
            opened.append(entry.open(workdir, cfg, start_step, **extra))
    except BaseException:
        for sink in opened:
            sink.close()
        raise
    return opened
