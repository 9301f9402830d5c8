"""What every tier of Checkpoints shares (jaxtrain/checkpoint.py says what a tier is):
picking the tier of a directory, health marks and the rotation policy, the fallback past
damaged steps, and how a saved tree differs from the one a run expects."""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxtrain import storage
from jaxtrain.fingerprints import tree_signature
from jaxtrain.rotation import HealthyRotation

_TIERS: dict[str, type] = {}  # "local", "remote": filled by the tiers' modules


class Checkpoints:
    """One directory of checkpoints (a tier). Checkpoints(directory, ...) is the tier of
    that directory: checkpoint_local.LocalCheckpoints on disk,
    checkpoint_remote.RemoteCheckpoints on a bucket (jaxtrain.checkpoint imports both).

    directory: a local path, or a gs:// or s3:// path. on_commit(step) is called (on a
    background thread) once a step is committed. read_only: for reading a run that may be
    training right now (eval, generate, export): nothing is created, cleaned up or deleted.
    manifests: where the local tier keeps its manifests (default: beside the directory)."""

    def __new__(cls, directory, *args, **kwargs):
        if cls is Checkpoints:
            cls = _TIERS["local" if storage.on_disk(directory) else "remote"]
        return super().__new__(cls)

    def __init_subclass__(cls, where: str, **kwargs):
        super().__init_subclass__(**kwargs)
        _TIERS[where] = cls

    def __init__(self, keep: int, keep_period: int, log: Callable[[str], None],
                 on_commit: Callable[[int], None] | None, read_only: bool):
        self.keep, self.keep_period, self.log = keep, keep_period, log
        self.on_commit, self.read_only = on_commit, read_only
        self.rotation = HealthyRotation(keep, keep_period)
        # Process 0 writes markers and manifests and moves damaged steps; a reader nothing.
        self.primary = jax.process_index() == 0 and not read_only
        self.healthy: set[int] = set()

    # Health and rotation (each tier: _record_health, _delete)

    def mark_healthy(self, step: int) -> None:
        """Training was healthy at or after `step`: it counts toward `keep` from now on."""
        if step in self.healthy:
            return
        self.healthy.add(step)
        self._record_health(step)
        self.rotate()

    def rotate(self) -> None:
        """Deletes what the rotation policy dooms (rotation.HealthyRotation)."""
        # From the health marks, which every process of a job sets at the same step, not
        # from the committed steps, whose newest one a process may see before another does.
        for step in self.rotation.doomed(self.steps(), self.healthy):
            self.healthy.discard(step)
            self._delete(step)

    # Restoring (each tier: _read, restore, restore_items, signature, set_aside)

    def newest_intact(self, target: dict, check_config: Callable[[int, dict, str | None], None],
                      verify: bool = True, above: int = -1):
        """(step, restored tree, saved config, saved sums or None) of the newest intact
        checkpoint newer than `above`, or None. Damaged steps are reported, set aside and
        skipped. check_config(step, saved config, how the saved tree differs from `target`
        or None) raises ConfigError for a checkpoint this run cannot continue."""
        for step in reversed([s for s in self.steps() if s > above]):
            restored, saved, sums, problem = self._read(step, verify, target, check_config)
            if problem is None:
                return step, restored, saved, sums
            self.set_aside_damaged(step, problem)
        return None

    def set_aside_damaged(self, step: int, problem: str) -> None:
        """Sets a damaged step aside (`problem` says how it is damaged) and says so."""
        moved = self.set_aside(step)
        self.log(f"jaxtrain: checkpoint step {step} in {self.directory} is damaged: "
                 f"{problem}; moved to {moved}, falling back to the previous one")

    def mismatch(self, step: int, target: dict) -> str | None:
        """How the saved tree differs from `target` ('lacks opt_state/...'), None if not."""
        return describe_mismatch(self.signature(step), tree_signature(target))

    def restore_params(self, step: int, target_params: dict) -> dict:
        """Only the parameters of a step (no optimizer state), into `target_params`' shapes
        and shardings: what generation, evaluation and export read."""
        return self.restore_items(step, {"params": target_params})["params"]


def describe_mismatch(saved: dict, wanted: dict) -> str | None:
    """How a saved tree's signature differs from the wanted one ('lacks opt_state/...'),
    None if not."""
    if saved == wanted:
        return None
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    reshaped = sorted(p for p in set(saved) & set(wanted) if saved[p] != wanted[p])
    parts = [f"{label} {'/'.join(paths[0])}" + (f" (+{len(paths) - 1} more)"
                                                 if len(paths) > 1 else "")
             for label, paths in (("lacks", missing), ("has an extra", extra),
                                  ("differs in shape or dtype at", reshaped)) if paths]
    return "; ".join(parts)
