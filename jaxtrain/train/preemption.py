"""Stop requests: SIGTERM/SIGINT mean 'checkpoint at the next step boundary and exit 0'.

The signals themselves are caught by jaxtrain/signals.py (from the start of the process
under `jaxtrain train`); this is where the loop asks whether to stop. With several
processes, jax's preemption notifier catches SIGTERM instead, and its sync point makes
every process stop at the same step, so that they all save it.
"""

from __future__ import annotations

import jax
from jax.experimental import multihost_utils

from jaxtrain.signals import STOP_SIGNALS, StopSignals


class StopRequest:
    """Within `with StopRequest() as stop:` the process's signal handlers are in place
    (installed here if the command did not already, and then removed on exit)."""

    def __init__(self, signals: StopSignals = STOP_SIGNALS):
        self.signals = signals
        self._installed_here = False

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
