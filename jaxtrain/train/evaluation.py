"""Validation loss on a fixed set of batches, every eval_every_steps and at the end."""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain.train.hooks import Hook, StepInfo, due


class Evaluator(Hook):
    """`with_reference`: the eval step takes the state's reference parameters too (an
    objective with a reference model: DPO's loss on validation pairs)."""

    def __init__(self, eval_step, val_batches: list, every: int, logger,
                 with_reference: bool = False):
        self.eval_step, self.val_batches, self.every = eval_step, val_batches, every
        self.logger, self.with_reference = logger, with_reference

    def evaluate(self, state) -> float:
        params = state.model_params()
        extra = (state.reference_params(),) if self.with_reference else ()
        return float(np.mean(jax.device_get([self.eval_step(params, b, *extra)
                                             for b in self.val_batches])))

    def after_step(self, info: StepInfo) -> None:
        if due(info.step, self.every, info.last):
            with self.logger.outside_steps("eval"):
                value = self.evaluate(info.state)
            self.logger.attach(info.step, {"val_loss": value})
