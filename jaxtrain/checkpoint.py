"""Orbax checkpoints of the train state (and the resolved config), saved asynchronously."""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp

from jaxtrain.train.state import TrainState


class Checkpoints:
    def __init__(self, directory: pathlib.Path, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(directory.absolute(), options=options,
                                             item_names=("state", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, config: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config)))

    def restore(self, step: int, target: TrainState) -> TrainState:
        """Restores into `target`'s shapes and shardings (any mesh: orbax reshards)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))
        return restored.state

    def saved_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore())).config

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
