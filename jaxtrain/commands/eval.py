"""jaxtrain eval --workdir RUN [--data FILE] [--batches N] [--devices N]
   jaxtrain eval --workdir RUN --tasks hellaswag,arc_easy,my_task.yaml,items.jsonl
       [--task_dir DIR] [--limit N] [--num_fewshot K] [--batch ROWS]
       [--devices N --fsdp N --tensor N] [--log_samples] [--out FILE]

Loss, perplexity and bits per token/byte of a run's newest checkpoint (or a quantized model
directory) as one JSON line, each the mean over the counted targets of the batches (a batch
weighs by its targets); for a DPO run (train.objective=dpo) its DPO loss and TRL's rewards
and accuracy instead, each the mean over the pairs (what the objective's entry in
objectives.py OBJECTIVES `reports`): on the run's validation split by default, or on a token file
(`.bin`, in the run's data.dtype) or a text file (any other name; encoded with the run's
tokenizer). Bits per byte come from real byte counts: the UTF-8 bytes each evaluated target
token stands for, by the tokenizer of the ids (the data source's for the validation split,
else the run's, WORKDIR/tokenizer); where there is none, or an id is outside it (an import
without a tokenizer), pass --bytes_per_token (the tokenizer's average on that text), else
bits_per_byte is null and stderr says why.

With --tasks: downstream tasks through lm-evaluation-harness (docs/evaluation.md), scored
on a data × fsdp × tensor mesh with the run's tokenizer: a table on stderr, the scores as
one JSON line, lm_eval's full results in RUN/evals/ (or --out).
"""

from __future__ import annotations

import datetime
import json
import math
import sys

import jax
import numpy as np
from absl import flags, logging

from jaxtrain import inference, storage
from jaxtrain.commands.common import run_absl
from jaxtrain.data import record
from jaxtrain.data.batches import to_global
from jaxtrain.data.packing import Packed, batch_targets
from jaxtrain.errors import DataError
from jaxtrain.models import lora
from jaxtrain.objectives import OBJECTIVES
from jaxtrain.tasks import BACKENDS, TaskSpec
from jaxtrain.tasks.text import run_tokenizer
from jaxtrain.train import evaluation, frozen
from jaxtrain.train.state import REFERENCE
from jaxtrain.train.task_eval import RESULTS_DIR


def _define_flags() -> dict:
    values = {
        "workdir": flags.DEFINE_string("workdir", None, "A run directory, or a quantized "
                                       "model's."),
        "data": flags.DEFINE_string("data", None, "A token file (.bin) or text file; "
                                    "default: the run's validation split."),
        "batches": flags.DEFINE_integer("batches", None, "Batches to evaluate (default: the "
                                        "run's eval_batches for the validation split, or as "
                                        "many as it holds if fewer; all of a file)."),
        "devices": flags.DEFINE_integer("devices", 1, "Devices to spread the batch over "
                                        "(data parallel)."),
        "bytes_per_token": flags.DEFINE_float("bytes_per_token", None, "For bits per byte of "
                                              "a model whose tokens are not bytes."),
        **_task_flags(),
    }
    flags.mark_flags_as_required(["workdir"])
    return values


def target_bytes(tokenizer, windows, count: int) -> int | None:
    """UTF-8 bytes of the text the target tokens of the first `count` windows stand for
    (packed rows: their counted targets, a chat dataset's loss mask included); None where
    an id is outside the tokenizer."""
    table = tokenizer.token_bytes()
    total = 0
    for i in range(count):
        row = windows[i]
        targets = row.tokens[1:][batch_targets(row)] if isinstance(row, Packed) \
            else row[1:]
        if len(targets) and int(targets.max()) >= len(table):
            return None
        total += int(table[targets].sum())
    return total


def per_byte(result: dict, tokenizer, windows, count: int,
             bytes_per_token: float | None) -> dict:
    """`bytes` and `bits_per_byte` of an evaluation: real byte counts by the tokenizer of the
    windows' ids where it covers them, else --bytes_per_token; else null, said on stderr."""
    counted = None if tokenizer is None else target_bytes(tokenizer, windows, count)
    if counted is not None:
        return {"bytes": counted,
                "bits_per_byte": result["bits_per_token"] * result["tokens"] / counted}
    if bytes_per_token is not None:
        return {"bits_per_byte": result["bits_per_token"] / bytes_per_token}
    why = ("the run has no tokenizer" if tokenizer is None
           else f"the data holds ids outside the run's tokenizer ({tokenizer.describe()})")
    print(f"jaxtrain: bits_per_byte is null: {why}, so the bytes a token stands for are "
          "unknown; pass --bytes_per_token (the tokenizer's average on this text)",
          file=sys.stderr)
    return {"bits_per_byte": None}


def _task_flags() -> dict:
    return {
        "tasks": flags.DEFINE_list("tasks", None, "Downstream tasks: lm_eval task names, task "
                                   "YAML files, JSONL files of multiple-choice items."),
        "task_dir": flags.DEFINE_list("task_dir", None, "Directories of task YAML files."),
        "limit": flags.DEFINE_integer("limit", None, "Documents per task (default: all)."),
        "num_fewshot": flags.DEFINE_integer("num_fewshot", None, "Few-shot examples (default: "
                                            "each task's own)."),
        "batch": flags.DEFINE_integer("batch", 8, "Rows per scoring batch.", lower_bound=1),
        "fsdp": flags.DEFINE_integer("fsdp", 1, "Devices to shard the parameters over (with "
                                     "--tasks).", lower_bound=1),
        "tensor": flags.DEFINE_integer("tensor", 1, "Devices to split each layer over, tensor "
                                       "parallel (with --tasks).", lower_bound=1),
        "backend": flags.DEFINE_enum("backend", "lm_eval", list(BACKENDS), "Task evaluation "
                                     "backend."),
        "log_samples": flags.DEFINE_bool("log_samples", False, "Keep every request and "
                                         "response in the results file."),
        "bootstrap_iters": flags.DEFINE_integer("bootstrap_iters", 100_000, "Bootstrap "
                                                "iterations for standard errors (0: none)."),
        "out": flags.DEFINE_string("out", None, "The results file (default: "
                                   f"RUN/{RESULTS_DIR}/tasks-stepN-TIME.json)."),
    }


def _evaluate_tasks(f: dict) -> None:
    """Loads the tasks (a misspelt task fails first), then the model, evaluates, and writes
    the results."""
    workdir = storage.as_path(f["workdir"].value, "--workdir")
    backend = BACKENDS[f["backend"].value]
    backend.check("--backend")
    spec = TaskSpec(tuple(f["tasks"].value), tuple(f["task_dir"].value or ()),
                    f["limit"].value, f["num_fewshot"].value, key="--tasks")
    tasks = backend.load(spec)
    step, cfg = inference.run_config(workdir)
    tokenizer = run_tokenizer(cfg, workdir)
    scorer, loaded = inference.task_scorer(workdir, data=f["devices"].value,
                                           fsdp=f["fsdp"].value, tensor=f["tensor"].value,
                                           batch=f["batch"].value)
    results = tasks.evaluate(scorer, tokenizer, log_samples=f["log_samples"].value,
                             bootstrap_iters=f["bootstrap_iters"].value)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    default = f"{workdir}/{RESULTS_DIR}/tasks-step{step}-{stamp}.json"
    out = storage.as_path(f["out"].value or default, "--out")
    storage.make_parent(out)
    about = {"workdir": str(workdir), "step": step, "tasks": list(spec.tasks),
             "mesh": dict(scorer.mesh.shape), "batch": scorer.batch,
             "tokenizer": tokenizer.describe(), "quantized": loaded.quantization is not None}
    storage.write_json(out, {"jaxtrain": about, **results.details}, indent=2,
                       default=tasks.json_default)
    print(tasks.table(results.details), file=sys.stderr)
    print(json.dumps({**about, "scores": results.scores, "results": str(out)}))


def _evaluate(f: dict, argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if f["tasks"].value:
        return _evaluate_tasks(f)
    workdir, data = f["workdir"].value, f["data"].value
    step, cfg = inference.run_config(workdir)
    objective = OBJECTIVES[cfg.train.objective]
    check_data(objective, data)
    tokenizer = record.run_tokenizer(workdir, cfg)
    name, windows, ids_of = inference.evaluation_windows(cfg, data, tokenizer)
    rows = cfg.train.global_batch
    batches = batch_count(name, windows, rows, f["batches"].value,
                          cfg.eval_batches if data is None else None)
    loaded = inference.load(workdir, data=f["devices"].value, batch=rows)
    result = evaluate_windows(loaded, windows, batches)
    if objective.units == "tokens":
        used = min(batches * rows, len(windows))
        result.update(per_byte(result, ids_of, windows, used, f["bytes_per_token"].value))
    print(json.dumps({"workdir": str(workdir), "step": step, "data": name,
                      "objective": objective.name,
                      "quantized": loaded.quantization is not None, **result}))


def check_data(objective, data: str | None) -> None:
    """DataError (one line) for --data on a run whose objective does not score text: a DPO
    run is evaluated on preference pairs, which only its validation split holds."""
    if data is not None and objective.units != "tokens":
        raise DataError(f"--data={data}: a train.objective={objective.name!r} run is "
                        f"evaluated on its {objective.units} (its validation split), not "
                        "on a token or text file; leave --data out")


def batch_count(name: str, windows, rows: int, asked: int | None, default: int | None
                ) -> int:
    """Batches of `rows` to evaluate: `asked`, else at most `default` (the run's
    eval_batches), else all. Packed rows (documents, pairs) end in a batch padded with
    empty rows, which count nothing, so every row can be used; plain windows count every
    target, so only whole batches of them are."""
    packed = len(windows) > 0 and isinstance(windows[0], Packed)
    available = -(-len(windows) // rows) if packed else len(windows) // rows
    wanted = asked or min(default or available, available)
    if wanted < 1 or wanted > available:
        whole = "" if packed else " (only whole batches of plain windows: each counts all " \
            "its targets)"
        raise DataError(f"{name} holds {len(windows)} rows: fewer than {max(wanted, 1)} "
                        f"batches of {rows}{whole}")
    return wanted


def evaluate_windows(loaded, windows, batches: int) -> dict:
    """The run's objective on `batches` batches of its windows (the last padded with empty
    rows where packed rows run out): what the objective reports, each the mean over its
    units (counted targets, or pairs), and their number; with targets as units, perplexity
    and bits per token too."""
    setup, rows = loaded.setup, loaded.cfg.train.global_batch
    objective = setup.objective
    eval_step = jax.jit(setup.losses()[1])
    reference = _reference(loaded) if setup.uses_reference else None
    with jax.set_mesh(setup.mesh):
        means, weight = evaluation.evaluate_batches(
            eval_step, loaded.params, (to_global(_batch(windows, b, rows),
                                                 setup.tokens_sharding)
                                       for b in range(batches)), reference)
    result = {**{name: means[name] for name in objective.reports}, objective.units: int(weight)}
    if objective.units == "tokens":
        result.update(perplexity=math.exp(means["loss"]),
                      bits_per_token=means["loss"] / math.log(2))
    return result


def _batch(windows, b: int, rows: int):
    """Batch b of the windows: rows b·rows, ...; rows past the end are empty (packed rows
    only: zeros, no segment, nothing counted)."""
    taken = [windows[i] for i in range(b * rows, min((b + 1) * rows, len(windows)))]
    empty = jax.tree.map(np.zeros_like, taken[0])
    return jax.tree.map(lambda *r: np.stack(r), *taken, *[empty] * (rows - len(taken)))


def _reference(loaded) -> dict:
    """The reference model's parameters of an objective that runs one (DPO): with LoRA its
    frozen base, else train.dpo.reference's parameters, loaded as training loads them."""
    setup = loaded.setup
    if setup.spec.lora is not None:
        return lora.split(loaded.params)[1]
    return frozen.load(REFERENCE, loaded.cfg, setup.spec, setup.shardings)


def main(argv: list[str] | None = None) -> None:
    values = _define_flags()
    run_absl("eval", lambda args: _evaluate(values, args), argv,
             paths=("workdir", "data", "out", "tasks", "task_dir"))


if __name__ == "__main__":
    main()
