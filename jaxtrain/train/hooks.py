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
