"""What a task evaluation is asked to do, and what it gives back."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What to evaluate: task names or task files, where else to look for task files, and
    how much of each task."""

    tasks: tuple[str, ...]
    include: tuple[str, ...] = ()  # directories of task YAML files
    limit: int | None = None  # documents per task; None: all
    num_fewshot: int | None = None  # None: each task's own default
    key: str = "eval.tasks"  # the config key or flag the tasks came from, for errors

    @classmethod
    def from_config(cls, cfg) -> TaskSpec:
        e = cfg.eval
        return cls(split_list(e.tasks), split_list(e.task_dir), e.tasks_limit or None,
                   None if e.tasks_num_fewshot < 0 else e.tasks_num_fewshot)


@dataclasses.dataclass
class TaskResults:
    scores: dict[str, float]  # "tasks/TASK/METRIC" -> value, for the metric sinks
    details: dict  # the backend's own results (JSON-serialisable with its `default`)


def split_list(value: str) -> tuple[str, ...]:
    """'a, b,c' -> ('a', 'b', 'c')."""
    return tuple(part.strip() for part in str(value).split(",") if part.strip())
