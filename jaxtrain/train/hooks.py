"""What the training loop hands to the work it schedules around steps.

The loop (train/loop.py) only steps; logging, evaluation, checkpointing, profiling, the
non-finite-step guard and stop requests are hooks that each decide from the step number
whether this step is theirs (as Levanter's `Trainer.add_hook(fn, every=N)` and torchtitan's
`should_save`). A hook that must end the run raises Halt; the loop then saves the step and
stops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.errors import LeaseLost


@dataclasses.dataclass
class StepInfo:
    """The run just after a step: `step` steps are done."""

    step: int
    state: Any  # TrainState
    metrics: dict  # the step's metrics, still on the device
    last: bool  # the run's final step


class Hook:
    """Runs after every step (and optionally before); decides itself when to act."""

    def before_step(self, step: int) -> None:
        """Called with the number of the step about to run (steps done so far)."""

    def after_step(self, info: StepInfo) -> None:
        pass


class LeaseGuard(Hook):
    """Stops the run before the next step once its workdir lease is lost (taken over, or its
    heartbeat failed past the takeover time): LeaseLost, one line, exit code IN_USE. The
    writes themselves are fenced in storage (Lease.check); this keeps the training thread
    from computing steps it could never save. A flag read: no I/O on the training thread."""

    def __init__(self, lock):
        self.lock = lock

    def before_step(self, step: int) -> None:
        lost = getattr(self.lock, "lost", None)
        if lost is not None and lost.is_set():
            raise LeaseLost(f"--workdir={self.lock.workdir}: {self.lock.lost_reason}; "
                            f"stopped before step {step + 1}")


class Halt(Exception):  # noqa: N818 - a control-flow signal, like StopIteration
    """A hook ends the run after this step; the loop saves the step first.

    error=True: the run failed (the loop raises TrainingStopped with the message);
    else it stopped on request and exits normally."""

    def __init__(self, message: str, error: bool = False):
        super().__init__(message)
        self.error = error


def due(step: int, every: int, last: bool) -> bool:
    """Every `every` steps (0: never) and at the run's last step."""
    return last or (every > 0 and step % every == 0)
