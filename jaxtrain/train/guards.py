"""Hooks that end a run: too many non-finite steps in a row, or a stop request."""

from __future__ import annotations

from jaxtrain.train.hooks import Halt, Hook, StepInfo


class BadStepGuard(Hook):
    """Ends the run after `limit` non-finite (skipped) steps in a row. Reads each step's
    counter one step late, when it is on the host anyway, so the device never waits."""

    def __init__(self, limit: int, restored_at: int | None = None):
        """restored_at: the step of the checkpoint the run resumed from (None: fresh)."""
        self.limit, self.restored_at = limit, restored_at
        self.previous: tuple[int, dict] | None = None

    def after_step(self, info: StepInfo) -> None:
        previous, self.previous = self.previous, (info.step, info.metrics)
        if previous is None:
            return
        step, metrics = previous
        bad = int(metrics["bad_steps_in_a_row"])
        if bad >= self.limit:
            raise Halt(f"{bad} non-finite steps in a row up to step {step} "
                       f"(train.max_consecutive_bad_steps={self.limit}); no update was "
                       f"applied for them, and the state is checkpointed at step {info.step}; "
                       f"{self._advice(step - bad + 1)}", error=True)

    def _advice(self, first: int) -> str:
        """What to do about a run of non-finite steps that began at step `first`."""
        if self.restored_at is not None and first == self.restored_at + 1:
            # Not the training's dynamics: the very first step from the restored state.
            return (f"they began with the first step after restoring the checkpoint of step "
                    f"{self.restored_at}, so suspect that checkpoint's state, not the learning "
                    f"rate: move steps {self.restored_at} and later out of checkpoints/ to "
                    "resume from an earlier one")
        return f"lower the learning rate, or look at the data around step {first}, before resuming"


class StopOnRequest(Hook):
    """Ends the run at the step boundary after SIGTERM/SIGINT (or a multi-host preemption
    notice); the loop saves that step."""

    def __init__(self, stop):
        self.stop = stop

    def after_step(self, info: StepInfo) -> None:
        if not info.last and self.stop.should_stop(info.step):
            raise Halt(f"stopped at step {info.step} on {self.stop.signal_name or 'preemption'}"
                       "; the checkpoint is durable; run the same command to resume")
