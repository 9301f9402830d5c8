"""Validation loss on a fixed set of batches, every eval_every_steps and at the end."""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain.train.hooks import Hook, StepInfo, due


class Evaluator(Hook):
    def __init__(self, eval_step, val_batches: list, every: int, logger):
        self.eval_step, self.val_batches, self.every = eval_step, val_batches, every
        self.logger = logger

    def evaluate(self, params) -> float:
        return float(np.mean(jax.device_get([self.eval_step(params, b)
                                             for b in self.val_batches])))

    def after_step(self, info: StepInfo) -> None:
        if due(info.step, self.every, info.last):
            with self.logger.outside_steps("eval"):
                value = self.evaluate(info.state.model_params())
            self.logger.attach(info.step, {"val_loss": value})
