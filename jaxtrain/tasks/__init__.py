"""Downstream-task evaluation backends, one registry entry per `eval.backend`.

A backend loads a set of tasks once (names, task files, a per-task limit) and evaluates them
with a scorer (jaxtrain/scoring.py: log-likelihoods and decoding on a mesh) and the run's
tokenizer (tasks/text.py), returning flat scores for metrics.jsonl and its full results for
a JSON file. The backend knows nothing of meshes or checkpoints, so the same loaded tasks
serve `jaxtrain eval --tasks` on a checkpoint and the training loop on its live parameters
(train/task_eval.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxtrain.errors import fail, require_package
from jaxtrain.tasks import harness
from jaxtrain.tasks.spec import TaskResults, TaskSpec, split_list

__all__ = ["BACKENDS", "TaskBackend", "TaskResults", "TaskSpec", "split_list"]


@dataclasses.dataclass(frozen=True)
class TaskBackend:
    """One `eval.backend`: how it loads tasks, and the package it needs."""

    name: str
    doc: str
    load: Callable  # TaskSpec -> an object with evaluate(scorer, tokenizer, ...) -> TaskResults
    module: str  # the Python package it runs on
    install: str | None = None  # how to get it (None: errors.INSTALL's line)

    def check(self, key: str) -> None:
        """ConfigError (one line, naming key) when the backend's package is missing."""
        require_package(self.module, f"{key}={self.name!r}", self.install)

    def check_mesh(self, c, sizes: dict[str, int]) -> None:
        """ConfigError when the loop's task scoring (scoring.Scorer, which every backend
        scores with) cannot run on this mesh: a sequence split over context."""
        if str(c.eval.tasks).strip() and sizes.get("context", 1) > 1:
            fail("eval.tasks", c.eval.tasks, f"task scoring does not run on a mesh with "
                 f"mesh.context={sizes['context']}; score checkpoints with `jaxtrain eval "
                 "--tasks`")


BACKENDS: dict[str, TaskBackend] = {b.name: b for b in (
    TaskBackend("lm_eval", "EleutherAI's lm-evaluation-harness: its task catalogue and any "
                "local task YAML or JSONL file", harness.load, "lm_eval"),
)}


def defaults() -> dict:
    """The `eval` section of config.base_config(): downstream tasks during training
    (docs/evaluation.md), scored on the live parameters every tasks_every_steps and at the
    end, logged beside val_loss as tasks/TASK/METRIC."""
    return {
        "tasks": "",  # comma-separated task names, task YAML or JSONL files; "": none
        "tasks_every_steps": 0,  # 0: only at the end of the run
        "task_dir": "",  # comma-separated directories of task YAML files
        "tasks_limit": 0,  # documents per task; 0: all
        "tasks_num_fewshot": -1,  # -1: each task's own default
        "tasks_batch": 8,  # rows per scoring batch (rounded up to what the mesh splits)
        "backend": "lm_eval",  # BACKENDS
    }
