"""Where a run's time goes: a jax.profiler trace window, and data-wait vs device-time
accounting for every logged interval."""

from __future__ import annotations

import pathlib
import time

import jax

from jaxtrain import storage
from jaxtrain.train.hooks import Hook, StepInfo
from jaxtrain.workdir import PROFILE_DIR

DATA_WAIT_WARNING = 0.05  # of step time


class ProfileWindow(Hook):
    """Traces steps [start, start + count) into WORKDIR/profile and saves a device memory
    profile at the end of the window."""

    def __init__(self, workdir: pathlib.Path, start: int, count: int, enabled: bool,
                 say=print):
        # jax.profiler writes local files: on object storage, to this host's scratch disk,
        # uploaded when the window closes.
        self.output = storage.LocalMirror(workdir / PROFILE_DIR, "profile")
        self.directory = self.output.path
        self.start, self.stop = start, start + count
        self.enabled = enabled and start >= 0
        self.active = False
        self.say = say

    def before_step(self, step: int) -> None:
        if self.enabled and step == self.start:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after_step(self, info: StepInfo) -> None:
        if not (self.active and info.step == self.stop):
            return
        jax.block_until_ready(info.metrics)
        jax.profiler.stop_trace()
        jax.profiler.save_device_memory_profile(str(self.directory / "memory.prof"))
        self.active = False
        self.output.sync()
        self.say(f"jaxtrain: profiled steps {self.start}-{self.stop - 1} into "
                 f"{self.output.target} "
                 "(open with TensorBoard's profile tab or Perfetto; memory.prof with pprof)")


class DataClock:
    """Accumulates the host time spent waiting for input batches between logged steps."""

    def __init__(self):
        self.waited = 0.0

    def timed(self, fetch):
        start = time.perf_counter()
        value = fetch()
        self.waited += time.perf_counter() - start
        return value

    def take(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited
