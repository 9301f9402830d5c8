"""SIGTERM and SIGINT, caught from the start of the process: a first signal asks the run to
stop at the next step boundary with a checkpoint (before the first step: at once, with
nothing to save); a second one (a double Ctrl-C) does not lose that checkpoint; a third
exits at once, saying which step the next run resumes at.

This module imports nothing heavy, so `jaxtrain train` installs the handlers before jax
loads: a Ctrl-C while jax starts up or compiles is then a clean stop, not a
KeyboardInterrupt raised somewhere inside the runtime. With several processes, jax's
preemption notifier (started by jax.distributed) takes SIGTERM, and a SIGINT is turned into
a SIGTERM to this process so that every process stops at the same step
(train/preemption.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    def __init__(self):
        self.name: str | None = None  # the first signal's name, once one came
        self.count = 0
        self.saving_step: int | None = None  # a checkpoint being written, if any
        self.resume_step = 0  # the newest durable checkpoint: where a next run starts
        self.training = False  # steps have started (before: a stop has nothing to save)
        self.multi_process = False
        self._previous: dict = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> bool:
        """Catches SIGTERM and SIGINT (main thread only); True if this call installed."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        # Blocked across a re-exec (hostmem.py): a signal pending since then arrives now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(SIGNALS))
        return True

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def reset(self) -> None:
        """Forgets signals (a new run in the same process)."""
        self.name, self.count, self.saving_step, self.resume_step = None, 0, None, 0
        self.training = False

    def _say(self, message: str) -> None:
        print(f"jaxtrain: {message}", file=sys.stderr, flush=True)

    def _handle(self, signum, frame) -> None:
        del frame
        name = signal.Signals(signum).name
        if self.multi_process and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)  # jax's notifier: all processes stop together
            return
        self.count += 1
        if self.count == 1:
            self.name = name
            if self.training or self.multi_process:
                self._say(f"{name}: stopping at the end of this step with a checkpoint (a "
                          f"third {name} exits at once, without it)")
            else:
                self._say(f"{name}: stopping the start-up; nothing to save yet")
        elif self.count == 2:
            what = (f"the checkpoint of step {self.saving_step} is being written"
                    if self.saving_step is not None else "the run is stopping")
            self._say(f"second {name}: {what} and will finish first (a third {name} "
                      "abandons it)")
        else:
            abandoned = (f"; the checkpoint of step {self.saving_step} was abandoned"
                         if self.saving_step is not None else "")
            self._say(f"{name} again: exiting now without a new checkpoint{abandoned}; the "
                      f"next run resumes at step {self.resume_step}")
            os._exit(128 + signum)


# One per process: signal handlers are process-wide.
STOP_SIGNALS = StopSignals()
