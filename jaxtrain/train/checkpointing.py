"""The loop's checkpoints: restore (and check) or initialise the state, save on schedule and
on demand, in one or two tiers (a durable directory, and optionally a fast local one saved
more often).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import time
from collections.abc import Callable

import jax
import ml_collections

from jaxtrain import storage
from jaxtrain.checkpoint import Checkpoints
from jaxtrain.errors import CheckpointError, ConfigError
from jaxtrain.train.hooks import Hook, StepInfo, due
from jaxtrain.train.restore_check import RestoreRejected, contents_problem, state_problem
from jaxtrain.train.state import TrainState
from jaxtrain.workdir import CHECKPOINTS

# Config keys that fix the shapes and structure of the checkpointed state, checked by name
# before the tree itself is compared (a clearer message for the common cases).
STATE_KEYS = ("model.family", "model.d_model", "model.num_layers", "model.num_heads",
              "model.num_kv_heads", "model.head_dim", "model.mlp_dim", "model.vocab_size",
              "model.seq_len")
# Sections whose keys can change what the state holds (named when the tree differs).
STATE_SECTIONS = ("model", "train", "optimizer")


def _changed_keys(cfg, saved: dict) -> list[str]:
    changed = []
    for section in STATE_SECTIONS:
        for name, now in cfg[section].items():
            if isinstance(now, ml_collections.ConfigDict):  # a nested section, as saved
                now = json.loads(json.dumps(now.to_dict()))
            before = saved.get(section, {}).get(name, now)
            if isinstance(now, float) or isinstance(before, float):
                same = math.isclose(float(before), float(now)) if \
                    isinstance(before, (int, float)) and isinstance(now, (int, float)) else False
            else:
                same = before == now or (isinstance(now, tuple) and list(now) == before)
            if not same:
                changed.append(f"{section}.{name}={now!r} (was {before!r})")
    return changed


def check_same_run(cfg, workdir: pathlib.Path) -> Callable:
    """check_config for Checkpoints.newest_intact: refuses, in one line, a checkpoint of
    another model or one whose state this config would lay out differently."""
    def check(step: int, saved: dict, mismatch: str | None) -> None:
        for key in STATE_KEYS:
            section, name = key.split(".")
            before, now = saved.get(section, {}).get(name), cfg[section][name]
            if before != now:
                raise ConfigError(
                    f"{key}={now!r} does not match the checkpoint at step {step} in "
                    f"{workdir} ({key}={before!r}); use another --workdir, or the same model")
        if mismatch:
            changed = _changed_keys(cfg, saved)
            keys = f" ({', '.join(changed)})" if changed else ""
            raise ConfigError(
                f"the checkpoint at step {step} in {workdir} does not fit this config"
                f"{keys}: its state {mismatch}; resume with the config it was saved with, "
                "or use another --workdir")
    return check


def local_tier_dir(local_dir: str, workdir: pathlib.Path) -> pathlib.Path:
    """The run's own directory under checkpoint.local_dir: runs of different workdirs may
    share one fast disk without resuming or rotating each other's checkpoints."""
    path = storage.canonical(workdir)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    return pathlib.Path(local_dir) / f"{path.name}-{digest}"


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where a restored state came from: its step, its tier, the config it was saved with,
    and its fingerprints as saved (Checkpoints.restore_sums; None before they were)."""

    step: int
    tier: Checkpoints
    saved: dict
    sums: dict | None = None


class Tiers:
    """The run's checkpoint directories: durable (workdir/checkpoints) and, with
    checkpoint.local_dir, a local tier saved every checkpoint.local_every_steps."""

    def __init__(self, cfg, workdir: pathlib.Path, log: Callable[[str], None],
                 on_commit: Callable[[int], None] | None = None):
        c = cfg.checkpoint
        self.durable = Checkpoints(workdir / CHECKPOINTS, c.keep, c.keep_period, log=log,
                                   on_commit=on_commit)
        self.local = None
        if c.local_dir:
            local = local_tier_dir(c.local_dir, workdir)
            self.local = Checkpoints(local / CHECKPOINTS, c.local_keep, log=log,
                                     manifests=local / "checkpoint_manifests",
                                     on_commit=on_commit)
        # The steps there were when the run started: if every one of them is set aside (at
        # restore, or a fallback's), the run stops rather than start afresh.
        self.found = {str(tier.directory): tier.steps() for tier in self.all if tier.steps()}

    @property
    def all(self) -> list[Checkpoints]:
        return [t for t in (self.durable, self.local) if t is not None]

    def newest_step(self) -> int:
        return max((s for tier in self.all for s in tier.steps()), default=0)

    def restore(self, target: dict, check: Callable, verify: bool
                ) -> tuple[Restored | None, dict | None]:
        """(where it came from, tree) of the newest intact checkpoint across the tiers
        (durable first on a tie), or (None, None)."""
        best, tree = None, None
        for tier in self.all:
            found = tier.newest_intact(target, check, verify,
                                       above=-1 if best is None else best.step)
            if found is not None:
                best, tree = Restored(found[0], tier, found[2], found[3]), found[1]
        if best is None and self.found:
            listed = "; ".join(f"{d} (steps {', '.join(map(str, s))})"
                               for d, s in self.found.items())
            raise CheckpointError(f"none of the checkpoints in {listed} is usable (they were "
                                  "set aside as damaged); move the directory away to start "
                                  "afresh")
        return best, tree

    def close(self) -> None:
        for tier in self.all:
            tier.close()


def restore_or_init(tiers: Tiers, setup, workdir: pathlib.Path
                    ) -> tuple[int, TrainState, Restored | None, float]:
    """(step, state, where it was restored from, seconds restoring took): the newest intact
    checkpoint's, else a fresh state at 0 (restored None; a checkpoint that jaxtrain convert
    wrote is restored at step 0). Raises RestoreRejected for a state that cannot be right
    (train/restore_check.py)."""
    began = time.perf_counter()
    restored, tree = tiers.restore(setup.abstract_state().tree(),
                                   check_same_run(setup.cfg, workdir),
                                   setup.cfg.checkpoint.verify_on_restore)
    if tree is None:
        return 0, setup.init_state(), None, time.perf_counter() - began
    state = TrainState.from_tree(tree)
    if problem := (state_problem(state, setup.shardings)
                   or contents_problem(tree, restored.sums)):
        raise RestoreRejected(restored, f"restored, {problem}")
    state = setup.with_base(state, fresh=False)  # LoRA: the base again, and the same one
    return restored.step, state, restored, time.perf_counter() - began


class Checkpointer(Hook):
    """Saves every checkpoint.every_steps steps (and local_every_steps to the local tier)
    and at the last step, never a step twice; marks a checkpoint healthy once a step at or
    after it is seen to train normally, which lets it count toward checkpoint.keep."""

    def __init__(self, tiers: Tiers, cfg, logger, restored_step: int, stop=None):
        self.tiers, self.cfg, self.logger, self.stop = tiers, cfg, logger, stop
        # Steps saved, per tier: a stop on a step the local tier just took still owes the
        # durable tier its copy.
        self.saved = {tier: {restored_step} for tier in tiers.all}
        self.unjudged: list[tuple[Checkpoints, int]] = []  # saved, health not yet seen
        self.previous: StepInfo | None = None

    def after_step(self, info: StepInfo) -> None:
        self._judge(self.previous)  # its metrics are ready by now: no wait for the device
        self.previous = info
        c = self.cfg.checkpoint
        if due(info.step, c.every_steps, info.last):
            self.save(info.step, info.state, last=info.last)
        elif self.tiers.local is not None and due(info.step, c.local_every_steps, False):
            self.save(info.step, info.state, self.tiers.local)

    def finish(self) -> None:
        """At the end of the run: judge the last step, and wait for every save."""
        self._judge(self.previous)
        for tier in self.tiers.all:
            tier.wait()

    def save(self, step: int, state: TrainState, tier: Checkpoints | None = None,
             last: bool = False) -> None:
        """last: the run's final step (a remote tier waits for a store that does not answer,
        checkpoint_remote.py)."""
        tier = tier or self.tiers.durable
        if step in self.saved[tier]:  # e.g. a stop request right after a periodic save
            return
        self.saved[tier].add(step)
        self.logger.flush()  # the rows up to this step are written before it is saved,
        with self.logger.outside_steps("checkpoint"):
            self.logger.writer.flush()  # and handed to the log's writer (object storage:
            # a segment, stored by its thread: the training thread never waits on the store)
            tier.save(step, state.tree(), self.cfg.to_dict(), last=last)
        self.unjudged.append((tier, step))

    def save_and_wait(self, step: int, state: TrainState) -> None:
        """A durable checkpoint of `step`, committed when this returns (for a stop)."""
        if self.stop is not None:
            self.stop.saving(step)
        self.save(step, state, last=True)
        with self.logger.outside_steps("checkpoint"):
            for tier in self.tiers.all:  # a local save of this step may still be in flight
                tier.wait()
        if self.stop is not None:
            self.stop.saving(None)

    def _judge(self, info: StepInfo | None) -> None:
        if info is None or not self.unjudged or not info.metrics:
            return
        metrics = jax.device_get({k: info.metrics[k] for k in ("loss", "bad_steps_in_a_row")})
        if not (math.isfinite(float(metrics["loss"])) and int(metrics["bad_steps_in_a_row"]) == 0):
            return
        ready = [(t, s) for t, s in self.unjudged if s <= info.step]
        self.unjudged = [(t, s) for t, s in self.unjudged if s > info.step]
        for tier, step in ready:
            tier.mark_healthy(step)
