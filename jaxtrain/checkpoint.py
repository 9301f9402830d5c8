"""Orbax checkpoints of the train state and the resolved config: async, atomic, verified.

orbax writes each step to a temporary directory and renames it when complete, so a
half-written step is never listed. On top of that we record a manifest (every file and its
size) once a save is durable, so that a checkpoint damaged later (truncated or deleted files)
is recognised at restore and the next older one is used instead. A damaged step is moved to
checkpoints_damaged/, never deleted; only orbax's own `keep` policy deletes checkpoints.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Callable

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxtrain.train.state import TrainState


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected; the message is one line."""


class Checkpoints:
    def __init__(self, directory: pathlib.Path, keep: int, keep_period: int = 0,
                 log: Callable[[str], None] = print):
        self.directory = directory.absolute()
        self.manifests = self.directory.parent / "checkpoint_manifests"
        self.log = log
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, keep_period=keep_period or None, create=True,
            enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "config"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: TrainState, config: dict) -> None:
        """Starts an async save (the device-to-host copy happens before this returns)."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_as_tree(state)), config=ocp.args.JsonSave(config)),
            force=True)
        self._write_manifests()

    def wait(self) -> None:
        """Blocks until every started save is durable on disk."""
        self.manager.wait_until_finished()
        self._write_manifests()

    def close(self) -> None:
        self.wait()
        self.manager.close()

    def restore_latest(self, target: TrainState,
                       check_config: Callable[[int, dict], None]) -> tuple[int, TrainState | None]:
        """(step, state) from the newest checkpoint that is intact; (0, None) if there is none.

        `check_config(step, saved_config)` may raise to refuse a checkpoint of another run.
        Damaged checkpoints are reported in one line each and skipped, never deleted.
        """
        steps = self.steps()
        for step in reversed(steps):
            problem = self._verify(step)
            if problem is None:
                try:
                    saved = self._restore_config(step)
                except Exception as e:  # noqa: BLE001 - any failure to read is damage
                    problem = f"its config cannot be read ({_first_line(e)})"
            if problem is None:
                check_config(step, saved)
                try:
                    return step, self.restore(step, target)
                except Exception as e:
                    if self._manifest_path(step).exists():
                        raise  # its files are all there: not damage (memory, mesh, ...)
                    problem = f"it cannot be restored ({_first_line(e)})"
            moved = self._set_aside(step)
            self.log(f"jaxtrain: checkpoint step {step} is damaged: {problem}; moved to "
                     f"{moved}, falling back to the previous one")
        if steps:
            raise CheckpointError(f"none of the checkpoints in {self.directory} (steps "
                                  f"{', '.join(map(str, steps))}) is usable; move them away "
                                  "to start afresh")
        return 0, None

    def _set_aside(self, step: int) -> pathlib.Path:
        """Moves a damaged step out of orbax's sight (so that the resumed run can save that
        step again) into checkpoints_damaged/, keeping it for inspection."""
        aside = self.directory.parent / "checkpoints_damaged" / f"{step}-{int(time.time())}"
        if jax.process_index() == 0:
            aside.parent.mkdir(parents=True, exist_ok=True)
            (self.directory / str(step)).rename(aside)
            self._manifest_path(step).unlink(missing_ok=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxtrain_set_aside_{step}")
        self.manager.reload()
        return aside

    def restore(self, step: int, target: TrainState) -> TrainState:
        """Restores into `target`'s shapes and shardings (any mesh: orbax reshards)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_as_tree(target)))).state
        return TrainState(**restored)

    def restore_params(self, step: int, target_params: dict) -> dict:
        """Only the parameters of a step (no optimizer state), into `target_params`' shapes
        and shardings: what generation, evaluation and export read."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item={"params": target_params},
                restore_args=ocp.checkpoint_utils.construct_restore_args(
                    {"params": target_params}),
                partial_restore=True))).state
        return restored["params"]

    def latest_intact(self) -> tuple[int, dict]:
        """(step, saved config) of the newest checkpoint whose files are all there."""
        for step in reversed(self.steps()):
            if self._verify(step) is None:
                return step, self._restore_config(step)
        raise CheckpointError(f"no intact checkpoint in {self.directory}")

    def _restore_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore())).config

    # Manifests: relative path -> size of every file of a durable step.

    def _manifest_path(self, step: int) -> pathlib.Path:
        return self.manifests / f"{step}.json"

    def _write_manifests(self) -> None:
        if jax.process_index() != 0:
            return
        self.manifests.mkdir(parents=True, exist_ok=True)
        finished = set(self.manager.all_steps())
        for path in self.manifests.glob("*.json"):  # steps orbax's keep policy removed
            if path.stem.isdigit() and int(path.stem) not in finished:
                path.unlink()
        for step in finished:
            manifest = self._manifest_path(step)
            if manifest.exists() or self.manager.is_saving_in_progress():
                continue
            root = self.directory / str(step)
            files = {str(p.relative_to(root)): p.stat().st_size
                     for p in sorted(root.rglob("*")) if p.is_file()}
            tmp = manifest.with_suffix(".tmp")
            tmp.write_text(json.dumps(files, indent=0))
            tmp.rename(manifest)

    def _verify(self, step: int) -> str | None:
        manifest = self._manifest_path(step)
        if not manifest.exists():
            return None  # saved but not yet recorded: orbax's atomic rename vouches for it
        root = self.directory / str(step)
        for name, size in json.loads(manifest.read_text()).items():
            path = root / name
            if not path.exists():
                return f"{path} is missing"
            actual = path.stat().st_size
            if actual != size:
                return f"{path} is truncated ({actual} of {size} bytes)"
        return None


def _as_tree(state: TrainState) -> dict:
    """The checkpointed tree: absent fields (loss_scale outside float16) are left out,
    since orbax cannot restore into a None."""
    tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
    if state.loss_scale is not None:
        tree["loss_scale"] = state.loss_scale
    return tree


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
