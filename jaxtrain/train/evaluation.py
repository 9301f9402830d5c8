"""Evaluation of a set of batches: validation loss every eval_every_steps and at the end of
training, and `jaxtrain eval` of a checkpoint.

An objective's eval step (objectives.py Objective.losses) gives per batch the sums of what
it reports over its units (counted targets, or pairs) and how many units it holds; the
means of a set of batches are its summed sums over its summed units, added up in float64
on the host. A batch of few counted targets then weighs little and one of none nothing (a
mean of per-batch means would count it as a loss of 0)."""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain.train.hooks import Hook, StepInfo, due


def weighted_means(sums: list[dict]) -> tuple[dict[str, float], float]:
    """({name: summed values / summed weights}, the summed weight) of per-batch eval
    outputs (device or host values); NaN means where the batches hold no units at all."""
    sums = jax.device_get(sums)
    weight = float(np.sum([np.float64(s["weight"]) for s in sums]))
    means = {name: (float(np.sum([np.float64(s[name]) for s in sums])) / weight
                    if weight else float("nan"))
             for name in sums[0] if name != "weight"}
    return means, weight


def evaluate_batches(eval_step, params, batches, reference=None) -> tuple[dict, float]:
    """weighted_means of eval_step over `batches` (with the reference parameters, for an
    objective that runs a reference model)."""
    extra = () if reference is None else (reference,)
    return weighted_means([eval_step(params, b, *extra) for b in batches])


class Evaluator(Hook):
    """`with_reference`: the eval step takes the state's reference parameters too (an
    objective with a reference model: DPO's loss on validation pairs)."""

    def __init__(self, eval_step, val_batches: list, every: int, logger,
                 with_reference: bool = False):
        self.eval_step, self.val_batches, self.every = eval_step, val_batches, every
        self.logger, self.with_reference = logger, with_reference

    def evaluate(self, state) -> float:
        """The validation loss: the mean over the validation batches' units."""
        reference = state.reference_params() if self.with_reference else None
        means, _ = evaluate_batches(self.eval_step, state.model_params(), self.val_batches,
                                    reference)
        return means["loss"]

    def after_step(self, info: StepInfo) -> None:
        if due(info.step, self.every, info.last):
            with self.logger.outside_steps("eval"):
                value = self.evaluate(info.state)
            self.logger.attach(info.step, {"val_loss": value})
