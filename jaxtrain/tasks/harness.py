"""lm-evaluation-harness, natively: a jaxtrain model class registered with lm_eval (as
"jaxtrain") whose loglikelihood, loglikelihood_rolling and generate_until run on a scorer
(jaxtrain/scoring.py) with the run's tokenizer; no export to Hugging Face.

Tasks are lm_eval's own: names from its catalogue (their data fetched by `datasets` where
the network allows), task YAML files or directories of them, and, as a shortcut, a JSONL file
of multiple-choice items `{"question": ..., "choices": [...], "label": i}`, which becomes a
task named after the file. They are loaded once and evaluated as often as asked.

lm_eval (and `datasets` under it) takes seconds to import, so it is imported only where a
task evaluation runs, never by training runs without eval.tasks.
"""

from __future__ import annotations

import functools
import logging
import pathlib

from jaxtrain.errors import DataError
from jaxtrain.tasks.spec import TaskResults, TaskSpec
from jaxtrain.tasks.text import boundary_id

SAMPLING_SEED = 1234  # lm_eval's default seed; used where a task asks for sampling
SKIPPED_FIELDS = ("alias", "name", "sample_len")


def load(spec: TaskSpec) -> HarnessTasks:
    """The tasks of `spec`, loaded (their documents read); DataError (one line) for a task
    no index knows or whose data cannot be read."""
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task config chatter
    specs = [_task_spec(name, spec.key) for name in spec.tasks]
    include = [str(pathlib.Path(p).expanduser()) for p in spec.include] or None
    named = [s for s in specs if isinstance(s, str) and not pathlib.Path(s).is_file()]
    manager = TaskManager(include_path=include, include_defaults=False)
    if any(name not in manager.all_tasks for name in named):
        manager = TaskManager(include_path=include)  # lm_eval's catalogue: seconds to index
        unknown = [name for name in named if name not in manager.all_tasks]
        if unknown:
            raise DataError(f"{spec.key}: no task {unknown[0]!r} among lm_eval's "
                            f"{len(manager.all_tasks)} tasks and groups, nor a task file of "
                            "that name (see `lm_eval ls tasks`, or pass a task YAML/JSONL "
                            "file or a directory of them)")
    try:
        task_dict = manager.load(specs)  # {"tasks": {name: Task}, "groups": ..., ...}
    except Exception as e:  # noqa: BLE001 - a task whose data or YAML cannot be read
        message = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"{spec.key}={','.join(spec.tasks)}: a task could not be loaded "
                        f"({type(e).__name__}: {message[:300]}); without network access "
                        "only local task files and cached datasets work") from None
    for task in task_dict["tasks"].values():
        if spec.num_fewshot is not None:
            task.set_config(key="num_fewshot", value=spec.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=SAMPLING_SEED)
    return HarnessTasks(spec, task_dict)


def _task_spec(name: str, key: str):
    """A task name or file as lm_eval takes it: a JSONL file becomes an inline task."""
    path = pathlib.Path(name).expanduser()
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise DataError(f"{key}: {name}: no such file")
        return {"task": path.stem, "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(path.resolve())}},
                "test_split": "test", "output_type": "multiple_choice",
                "doc_to_text": "question", "doc_to_choice": "choices",
                "doc_to_target": "label",
                "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                for m in ("acc", "acc_norm")]}
    if path.suffix in (".yaml", ".yml") and not path.is_file():
        raise DataError(f"{key}: {name}: no such file")
    return str(path) if path.is_file() else name


class HarnessTasks:
    """Loaded lm_eval tasks, evaluated with any scorer and tokenizer."""

    def __init__(self, spec: TaskSpec, task_dict: dict):
        self.spec, self.task_dict = spec, task_dict

    @staticmethod
    def json_default(value):
        """For json.dump of the results: lm_eval's handling of numpy values and the like."""
        from lm_eval.utils import handle_non_serializable

        return handle_non_serializable(value)

    @staticmethod
    def table(details: dict) -> str:
        """lm_eval's own results table (Markdown)."""
        from lm_eval.utils import make_table

        return make_table(details)

    def evaluate(self, scorer, tokenizer, log_samples: bool = False,
                 bootstrap_iters: int = 0) -> TaskResults:
        from lm_eval.evaluator import evaluate

        results = evaluate(lm=lm_class()(scorer=scorer, tokenizer=tokenizer),
                           task_dict=self.task_dict, limit=self.spec.limit,
                           bootstrap_iters=bootstrap_iters, log_samples=log_samples)
        return TaskResults(flat_scores(results), results)


def flat_scores(results: dict) -> dict[str, float]:
    """lm_eval's {"task": {"acc,none": v, "acc_stderr,none": s, ...}} as
    {"tasks/task/acc": v}: one number per task and metric (a filter other than "none" is
    appended to the metric's name; standard errors stay in the JSON results)."""
    scores = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, where = key.partition(",")
            if (key in SKIPPED_FIELDS or "_stderr" in metric or isinstance(value, bool)
                    or not isinstance(value, (int, float))):
                continue
            name = metric if where in ("", "none") else f"{metric}_{where}"
            scores[f"tasks/{task}/{name}"] = float(value)
    return scores


# --- the model class -----------------------------------------------------------------------

def loglikelihood_tokens(lm, requests) -> list[tuple[float, bool]]:
    """requests: ((context, continuation), context ids, continuation ids), lm_eval's form."""
    results = lm.scorer.loglikelihoods([(context, continuation)
                                        for _, context, continuation in requests])
    for (key, _, _), result in zip(requests, results):
        lm.cache_hook.add_partial("loglikelihood", key, result)
    return results


def loglikelihood_rolling(lm, requests) -> list[float]:
    """Each text's whole log-likelihood: disjoint windows of model.seq_len predictions, each
    with as much preceding context as fits, all scored in one batched pass."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows, owners = [], []
    for i, request in enumerate(requests):
        (text,) = request.args
        for window in get_rolling_token_windows(
                token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id,
                max_seq_len=lm.max_length, context_len=1):
            windows.append(make_disjoint_window(window))
            owners.append(i)
    totals = [0.0] * len(requests)
    for (logprob, _), i in zip(lm.scorer.loglikelihoods(windows), owners):
        totals[i] += logprob
    for request, total in zip(requests, totals):
        lm.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
    return totals


def generate_until(lm, requests) -> list[str]:
    """Continuations decoded by the generation engine (greedy unless a task asks for
    sampling), each ending as soon as it meets one of its stop strings or the tokenizer's
    end-of-text token, and cut there."""
    jobs: dict[tuple, list[int]] = {}
    prompts, stops = [], []
    for i, request in enumerate(requests):
        context, kwargs = request.args
        sampling, until = _sampling(dict(kwargs), lm.max_length)
        prompt = lm.tok_encode(context) or [lm.prefix_token_id]
        prompts.append(prompt[-(lm.max_length - sampling[0]):])
        stops.append(until)
        jobs.setdefault((sampling, tuple(until)), []).append(i)
    texts: list = [None] * len(requests)
    eos = () if lm.tokens.eos_id is None else (lm.tokens.eos_id,)
    for (sampling, until), chosen in jobs.items():
        outputs = lm.scorer.generate([prompts[i] for i in chosen], *sampling,
                                     seed=SAMPLING_SEED, stop=[s for s in until if s],
                                     tokenizer=lm.tokens, eos_ids=eos)
        for i, tokens in zip(chosen, outputs):
            texts[i] = _cut(lm, tokens, stops[i])
            lm.cache_hook.add_partial("generate_until", requests[i].args, texts[i])
    return texts


def _sampling(kwargs: dict, seq_len: int) -> tuple[tuple, list[str]]:
    """A task's generation_kwargs as ((max_new_tokens, temperature, top_k, top_p), stop
    strings)."""
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    new_tokens = min(int(kwargs.pop("max_gen_toks", 256)), seq_len - 1)
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    if not kwargs.pop("do_sample", False):
        temperature = 0.0
    return (new_tokens, temperature, int(kwargs.pop("top_k", 0) or 0),
            float(kwargs.pop("top_p", 1.0) or 1.0)), until


def _cut(lm, tokens: list[int], until: list[str]) -> str:
    eos = lm.tokens.eos_id
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos)]
    text = lm.tok_decode(tokens)
    ends = [text.find(stop) for stop in until if stop and stop in text]
    return text[:min(ends)] if ends else text


@functools.cache
def lm_class():
    """The lm_eval model class, made (and registered as "jaxtrain") on first use, so that
    importing jaxtrain never imports lm_eval. Construct it with a scorer and a tokenizer:
    `lm_class()(scorer=..., tokenizer=...)`, or `inference.task_model(workdir)`."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    @register_model("jaxtrain")
    class JaxtrainLM(TemplateLM):
        """A jaxtrain model for lm_eval: scores and decodes on its scorer's mesh."""

        backend = "causal"

        def __init__(self, scorer, tokenizer, **unused):
            del unused  # batch_size, device, ...: simple_evaluate's, fixed by the scorer
            super().__init__()
            self.scorer, self.tokens = scorer, tokenizer

        @property
        def eot_token_id(self) -> int:
            eos = self.tokens.eos_id
            return boundary_id(self.tokens) if eos is None else eos

        @property
        def prefix_token_id(self) -> int:
            return boundary_id(self.tokens)

        @property
        def max_length(self) -> int:
            return self.scorer.seq_len

        @property
        def tokenizer_name(self) -> str:
            return self.tokens.describe()

        def tok_encode(self, string, add_special_tokens=None, **kwargs) -> list[int]:
            return list(self.tokens.encode(string))

        def tok_decode(self, tokens, **kwargs) -> str:
            return self.tokens.decode(tokens)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            return loglikelihood_tokens(self, requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return loglikelihood_rolling(self, requests)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return generate_until(self, requests)

    return JaxtrainLM
