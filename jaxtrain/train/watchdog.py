"""A hang watchdog: if no step completes within train.step_timeout_s, every thread's stack
goes to the log and the process exits with HUNG, so a scheduler (or `jaxtrain launch
--max-restarts`) can start the job again instead of paying for a stuck accelerator.

Armed at the first completed step (compilation happens before it); the loop beats after
every step and around work between steps (evaluation, checkpoints), so the timeout must be
longer than the longest step and the longest evaluation or checkpoint save.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

HUNG = 4  # exit code: no step completed within train.step_timeout_s


class Watchdog:
    def __init__(self, timeout_s: float, say=print):
        self.timeout_s, self.say = timeout_s, say
        self.last: float | None = None  # None: not armed yet
        self.step = 0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="jaxtrain-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self, step: int | None = None) -> None:
        self.last = time.monotonic()
        if step is not None:
            self.step = step

    def _watch(self) -> None:
        period = min(max(self.timeout_s / 10, 0.1), 10.0)
        while not self._stop.wait(period):
            if self.last is not None and time.monotonic() - self.last > self.timeout_s:
                self._fire()

    def _fire(self) -> None:
        self.say(f"jaxtrain: no step completed for {self.timeout_s:g}s after step "
                 f"{self.step} (train.step_timeout_s): the run is hung; the stacks of every "
                 f"thread follow, then it exits with code {HUNG}")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(HUNG)
