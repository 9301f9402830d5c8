"""Stop requests: SIGTERM/SIGINT mean 'checkpoint at the next step boundary and exit 0'.

The signals themselves are caught by jaxtrain/signals.py (from the start of the process
under `jaxtrain train`); this is where the loop asks whether to stop. With several
processes, jax's preemption notifier catches SIGTERM instead, and its sync point makes
every process stop at the same step, so that they all save it.

Before the first step there is nothing to save, so a stop ends the start-up at once: the
loop checks between its phases, and waits for the long ones (restoring, compiling, the first
evaluation) on a worker thread, so that a stop ends the wait within 0.1 s. XLA cannot be
interrupted, so an abandoned phase goes on in the background, and `jaxtrain train` leaves
without waiting for it (leave_if_abandoned).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import jax
from jax.experimental import multihost_utils

from jaxtrain.signals import STOP_SIGNALS, StopSignals

T = TypeVar("T")
_POLL_S = 0.1
_abandoned: list[threading.Thread] = []  # start-up phases a stop left running


class StartupStopped(Exception):  # noqa: N818 - a control-flow signal, like StopIteration
    """A stop request came before the first step; `phase` says when ('while compiling')."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


class StopRequest:
    """Within `with StopRequest() as stop:` the process's signal handlers are in place
    (installed here if the command did not already, and then removed on exit)."""

    def __init__(self, signals: StopSignals = STOP_SIGNALS):
        self.signals = signals
        self._installed_here = False
        self.resume_at: int | None = None  # the newest durable step, once known
        self.abandoned: str | None = None  # a start-up phase left running on a stop

    def __enter__(self) -> StopRequest:
        self._installed_here = self.signals.install()
        self.signals.multi_process = jax.process_count() > 1
        return self

    def __exit__(self, *exc) -> None:
        self.signals.saving_step = None
        if self._installed_here:
            self.signals.uninstall()
            self.signals.reset()

    @property
    def signal_name(self) -> str | None:
        return self.signals.name

    def requested(self) -> bool:
        """A stop was asked for (single process; before any step, say)."""
        return jax.process_count() == 1 and self.signals.name is not None

    def check(self, phase: str) -> None:
        """Between start-up phases: StartupStopped if a stop was requested."""
        if self.requested():
            raise StartupStopped(phase)

    def during(self, phase: str, work: Callable[[], T]) -> T:
        """work(), a start-up phase ('restoring', 'compiling', 'evaluating') that may take
        minutes: run on a worker thread and waited for in 0.1 s slices, so that a stop
        request raises StartupStopped at once and leaves it running (abandoned). jax's
        thread-local settings (jax.set_mesh) do not reach the worker: `work` sets its own."""
        self.check(f"before {phase}")
        if jax.process_count() > 1 or not self.signals.installed:
            return work()  # no stop can end the start-up early (see requested)
        outcome: dict = {}

        def worker() -> None:
            try:
                outcome["value"] = work()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                outcome["error"] = e

        thread = threading.Thread(target=worker, name=f"jaxtrain-{phase}")
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            if thread.is_alive() and self.requested():
                self.abandoned = phase
                _abandoned.append(thread)
                raise StartupStopped(f"while {phase}")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def training_started(self) -> None:
        """The first step is about to run: a stop from now on saves a checkpoint."""
        self.signals.training = True

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signals.name is not None

    def saving(self, step: int | None) -> None:
        """A checkpoint of `step` is being written (None: no longer)."""
        self.signals.saving_step = step

    def durable(self, step: int) -> None:
        """The checkpoint of `step` is on disk: a next run resumes there."""
        self.signals.resume_step = max(self.signals.resume_step, step)
        self.resume_at = max(self.resume_at or 0, step)


def leave_if_abandoned(code: int = 0) -> None:
    """Exits the process now if a start-up phase a stop abandoned is still running (an XLA
    compile cannot be interrupted): Python's exit would wait for it, and then take jax down
    under it. Nothing of the run is in it: no step ran, nothing was being saved."""
    if any(thread.is_alive() for thread in _abandoned):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
