"""Which checkpoints a rotation deletes: a policy object, apart from where the steps lie
(orbax's `PreservationPolicy` has the same shape)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HealthyRotation:
    """Keeps the newest `keep` healthy checkpoints (a step is healthy once the run was
    training normally at or after it: finite loss, no skipped step) and every
    keep_period-th step. Unhealthy ones never count toward `keep`, so a checkpoint of a
    broken state never pushes the last good one out, and they are deleted only once older
    than the oldest kept healthy one."""

    keep: int
    keep_period: int = 0

    def doomed(self, steps, healthy) -> list[int]:
        """The steps among `steps` to delete, given the `healthy` ones; none before any
        step is healthy."""
        kept = sorted(healthy)[-self.keep:]
        if not kept:
            return []
        return [step for step in sorted(steps) if step < kept[0]
                and not (self.keep_period and step % self.keep_period == 0)]
