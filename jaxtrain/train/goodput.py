"""Goodput: the share of the wall time since a job first started that went into training
steps that count toward the final model, across restarts.

Each run of the job (a session) records in WORKDIR/goodput.json when it started, the step it
resumed at, the device time of its steps by step range, and the time it lost by cause; the
file is rewritten at every logged step, so a killed session leaves its record up to its
last log. The summary charges to `recomputed` the steps a session ran past the step the next
session resumed at (they were done again), and to `restart` the gaps between sessions (a
dead process, the scheduler's delay, the time after a session's last log).

A session that ends deliberately (it reached its steps, or stopped on SIGTERM or Ctrl-C with
its checkpoint durable) records so (`clean`); the gap until the next start is then the
user's choice, not the job's loss: it is reported apart as `idle_s` and left out of the
wall time goodput is a share of.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

from jaxtrain.outbox import Outbox
from jaxtrain.workdir import GOODPUT_FILE as FILE

# Causes of lost time within a session (restart and recomputed come from the sessions).
# On object storage each save is a PUT (billed): at most one per this many seconds, and at
# the end; a killed session's record then ends up to this long before its last log.
REMOTE_SAVE_S = 60.0
CAUSES = ("startup", "checkpoint", "eval", "data")
LOST = CAUSES + ("restart", "recomputed")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Goodput:
    def __init__(self, workdir: pathlib.Path, started: float, resumed_at: int,
                 enabled: bool = True, outbox: Outbox | None = None):
        """outbox: the run's writer (outbox.py): on object storage the file is written by
        its thread, never on the training thread."""
        self.path = workdir / FILE
        self.enabled = enabled
        self.outbox = outbox or Outbox(workdir, _say)
        self.previous = self._load(resumed_at) if enabled else []
        self.session = {"start": started, "end": started, "resumed_at": resumed_at,
                        "productive": [], "lost": {cause: 0.0 for cause in CAUSES}}
        self._startup_open = True

    def _load(self, resumed_at: int) -> list[dict]:
        try:
            sessions = json.loads(self.path.read_text())["sessions"]
        except (OSError, ValueError, KeyError):
            return []
        # A session that started past this resume point was itself recomputed: keep it.
        return [s for s in sessions if isinstance(s, dict) and "start" in s]

    def lose(self, cause: str, seconds: float) -> None:
        self.session["lost"][cause] += seconds

    def training_started(self, now: float | None = None) -> None:
        """The first step starts: what came before (less what is charged elsewhere) was
        start-up: imports, building, restoring, compiling."""
        if not self._startup_open:
            return
        self._startup_open = False
        now = time.time() if now is None else now
        charged = sum(self.session["lost"].values())
        self.session["lost"]["startup"] += max(now - self.session["start"] - charged, 0.0)

    def steps(self, first: int, last: int, device_s: float, data_s: float) -> None:
        """Steps (first, last] took device_s of device time and waited data_s for data."""
        self.session["productive"].append([first, last, device_s])
        self.lose("data", data_s)

    def finished(self, now: float | None = None) -> None:
        """The session ends deliberately, its checkpoint durable: the time until the next
        start is idle, not lost."""
        self.session["end"] = time.time() if now is None else now
        self.session["clean"] = True
        self.save(force=True)

    def summary(self, now: float | None = None) -> dict:
        """goodput, the lost seconds by cause and the idle seconds, since the job first
        started."""
        now = time.time() if now is None else now
        self.session["end"] = now
        sessions = self.previous + [self.session]
        wall = max(now - sessions[0]["start"], 1e-9)
        productive, idle, lost = 0.0, 0.0, {cause: 0.0 for cause in LOST}
        for i, session in enumerate(sessions):
            # Any later session may have gone back past this one's steps (a resume from an
            # older checkpoint after the next one's newest was damaged): the earliest counts.
            redone_from = min((later["resumed_at"] for later in sessions[i + 1:]),
                              default=math.inf)
            for first, last, seconds in session["productive"]:
                kept = min(max(redone_from - first, 0), last - first) / max(last - first, 1)
                productive += seconds * kept
                lost["recomputed"] += seconds * (1 - kept)
            for cause, seconds in session["lost"].items():
                lost[cause] += seconds
            if i > 0:
                gap = max(session["start"] - sessions[i - 1]["end"], 0.0)
                if sessions[i - 1].get("clean"):
                    idle += gap
                else:  # a crash, a kill, a dead rank: the job lost it
                    lost["restart"] += gap
        row = {"goodput": productive / max(wall - idle, 1e-9), "wall_s": wall, "idle_s": idle}
        row.update({f"lost_{cause}_s": seconds for cause, seconds in lost.items()})
        return row

    def save(self, force: bool = False) -> None:
        """Writes the record (on object storage each save is a billed PUT: at most one per
        REMOTE_SAVE_S, the newest, unless `force`)."""
        if not self.enabled:
            return
        text = json.dumps({"sessions": self.previous + [self.session]}) + "\n"
        self.outbox.put(self.path, text, every_s=0.0 if force else REMOTE_SAVE_S)
