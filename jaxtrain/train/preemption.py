"""Stop requests: SIGTERM/SIGINT mean 'checkpoint at the next step boundary and exit 0'."""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils


class StopRequest:
    """Within `with StopRequest() as stop:`, the first SIGTERM or SIGINT sets a flag that the
    loop polls between steps; a second one exits at once. With several processes, jax's own
    preemption notifier (started by jax.distributed) catches SIGTERM instead, and its sync
    point makes every host stop at the same step, so that they all save it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            print(f"jaxtrain: second {name}: exiting now, without a checkpoint",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signal_name = name
        print(f"jaxtrain: {name}: saving a checkpoint at the end of this step, then exiting "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal_name is not None
