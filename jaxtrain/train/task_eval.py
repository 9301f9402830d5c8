"""Downstream tasks during training: eval.tasks scored on the current parameters (no
checkpoint round trip) every eval.tasks_every_steps and at the end, logged beside val_loss
as tasks/TASK/METRIC, with the backend's full results in WORKDIR/evals/.

The tasks are loaded before anything compiles (a misspelt task name stops the run at once);
the scorer compiles its few padded shapes at the first evaluation and reuses them after.
"""

from __future__ import annotations

import pathlib

import jax

from jaxtrain import storage
from jaxtrain.scoring import Scorer
from jaxtrain.tasks import BACKENDS, TaskSpec
from jaxtrain.tasks.text import data_tokenizer
from jaxtrain.train.hooks import Hook, StepInfo, due
from jaxtrain.workdir import RESULTS_DIR


def load_tasks(cfg) -> tuple | None:
    """(the run's eval.tasks loaded by their backend, the tokenizer of the run's ids); None
    when there are none. An unknown task or a run without a tokenizer fails here, before
    anything compiles or is written."""
    spec = TaskSpec.from_config(cfg)
    if not spec.tasks:
        return None
    tokenizer = data_tokenizer(cfg)
    return BACKENDS[cfg.eval.backend].load(spec), tokenizer


class TaskEvaluator(Hook):
    def __init__(self, loaded: tuple | None, setup, workdir: pathlib.Path, logger):
        """loaded: load_tasks's (tasks, tokenizer), or None (then the hook does nothing)."""
        self.tasks, self.tokenizer = loaded or (None, None)
        self.logger, self.workdir = logger, workdir
        cfg = setup.cfg
        self.every = cfg.eval.tasks_every_steps
        self.scorer = Scorer.from_setup(setup, cfg.eval.tasks_batch,
                                        progress=jax.process_index() == 0)

    def after_step(self, info: StepInfo) -> None:
        if self.tasks is None or not due(info.step, self.every, info.last):
            return
        with self.logger.outside_steps("eval"):
            scorer = self.scorer.bind(info.state.model_params())
            results = self.tasks.evaluate(scorer, self.tokenizer)
            self.scorer.bind(None)  # the state is donated to the next step
            if jax.process_index() == 0:
                self._save(info.step, results.details)
        self.logger.attach(info.step, results.scores)

    def _save(self, step: int, details: dict) -> None:
        directory = self.workdir / RESULTS_DIR
        directory.mkdir(exist_ok=True)
        path = directory / f"{self.tasks.spec.key.replace('.', '_')}-step{step}.json"
        storage.write_json(path, {"step": step, **details}, indent=2,
                           default=self.tasks.json_default)
