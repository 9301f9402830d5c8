"""Reward functions with TRL's signature, f(prompts, completions, **columns) ->
list[float | None] (None: this function does not score that completion), and one batch
scored by several of them.

A completion (or prompt) is a string, or a conversation (a list of {"role", "content"}
messages, TRL's conversational format); the built-ins read its text. Besides the dataset's
extra columns, every function is passed completion_ids (a list of token-id lists), as TRL
does. Built-ins (REWARDS; options from the config entry):
- answer: 1.0 when the completion's final answer equals the `column` column's (default
  "answer"), else 0.0; None where the row has no answer. The final answer is the last
  \\boxed{...}, else the text after the last '####' (GSM8K), or with `pattern` the last
  match of that regex (its first group if it has one). Compared after normalising (spaces,
  '$', thousands commas, a trailing '.'), numerically when both parse as numbers.
- format: 1.0 when the completion matches `pattern` (re.match, DOTALL | MULTILINE), else
  0.0; by default TRL's think_format_reward's pattern (<think>...</think> then the answer).
- overlong: DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment), by the
  completion's token count: 0 up to max_completion_len - soft_punish_cache, then falling
  linearly to -1 at max_completion_len, and -1 beyond.
Any other name is a user function by import path, 'module:function'.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Sequence

import numpy as np

from jaxtrain.errors import ConfigError, JaxtrainError
from jaxtrain.rl.advantages import nanmean, nanstd

THINK_PATTERN = r"^<think>(?!.*<think>)(.*?)</think>.*$"  # TRL's think_format_reward


class RewardError(JaxtrainError, RuntimeError):
    """A reward function that raised, or returned the wrong number or kind of values: one
    line naming the function and the prompt."""


def text_of(item) -> str:
    """The text of a prompt or completion: itself, or its messages' contents joined."""
    if isinstance(item, str):
        return item
    return "".join(str(m.get("content", "")) for m in item)


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, at = 1, start + len("\\boxed{")
    for i in range(at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[at:i]
    return None


def final_answer(text: str, pattern: str | None = None) -> str | None:
    """The final answer of a text: pattern's last match, else the last \\boxed{}, else what
    follows the last '####' (to the end of its line); None when there is none."""
    if pattern is not None:
        matches = list(re.finditer(pattern, text, re.DOTALL))
        if not matches:
            return None
        last = matches[-1]
        return last.group(1) if last.re.groups else last.group(0)
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    return None


def _normal(answer: str) -> str:
    answer = answer.strip().strip("$").strip().rstrip(".").strip()
    answer = re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer)  # 1,000 -> 1000
    return re.sub(r"\s+", " ", answer)


def same_answer(a: str, b: str) -> bool:
    a, b = _normal(a), _normal(b)
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except ValueError:
        return a == b


def answer_reward(column: str = "answer", pattern: str | None = None) -> Callable:
    def answer(prompts, completions, **columns):
        if column not in columns:
            raise RewardError(f"reward 'answer' needs the dataset column {column!r}; the "
                              f"batch has {', '.join(sorted(columns)) or 'none'}")
        out = []
        for completion, truth in zip(completions, columns[column], strict=True):
            if truth is None:
                out.append(None)
                continue
            gold = final_answer(str(truth)) or str(truth)  # '... #### 72' or a bare '72'
            got = final_answer(text_of(completion), pattern)
            out.append(float(got is not None and same_answer(got, gold)))
        return out
    return answer


def format_reward(pattern: str = THINK_PATTERN) -> Callable:
    compiled = re.compile(pattern, re.DOTALL | re.MULTILINE)

    def format_match(prompts, completions, **columns):
        return [float(compiled.match(text_of(c)) is not None) for c in completions]
    return format_match


def overlong_reward(max_completion_len: int, soft_punish_cache: int) -> Callable:
    start = max_completion_len - soft_punish_cache

    def overlong(prompts, completions, completion_ids, **columns):
        lengths = [len(ids) for ids in completion_ids]
        return [0.0 if n <= start else -1.0 if n > max_completion_len
                else (start - n) / soft_punish_cache for n in lengths]
    return overlong


REWARDS: dict[str, Callable[..., Callable]] = {
    "answer": answer_reward, "format": format_reward, "overlong": overlong_reward}


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str
    fn: Callable
    weight: float = 1.0


def _imported(path: str, key: str) -> Callable:
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={path!r} is invalid: cannot import it ({e}); give a "
                          f"built-in ({', '.join(REWARDS)}) or 'module:function'") from None
    if not callable(fn):
        raise ConfigError(f"{key}={path!r} is invalid: {type(fn).__name__} is not callable")
    return fn


def build_rewards(entries: Sequence[dict], key: str = "train.grpo.rewards") -> list[Reward]:
    """The reward functions of config entries {"name": built-in or 'module:function',
    "weight": float (default 1.0), and a built-in's options}."""
    rewards = []
    for i, entry in enumerate(entries):
        entry = dict(entry)
        name, weight = entry.pop("name", None), float(entry.pop("weight", 1.0))
        where = f"{key}[{i}]"
        if name in REWARDS:
            try:
                fn = REWARDS[name](**entry)
            except TypeError as e:
                raise ConfigError(f"{where} ({name}) options {sorted(entry)} are invalid: "
                                  f"{e}") from None
        elif isinstance(name, str) and re.fullmatch(r"[\w.]+:\w+", name) and not entry:
            fn = _imported(name, f"{where}.name")
        else:
            raise ConfigError(f"{where}.name={name!r} is invalid: valid values are "
                              f"{', '.join(REWARDS)} or 'module:function' (no options)")
        rewards.append(Reward(name, fn, weight))
    if not rewards:
        raise ConfigError(f"{key}=[] is invalid: give at least one reward function")
    return rewards


def _shown(prompt) -> str:
    text = text_of(prompt)
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _call(reward: Reward, prompts, completions, columns, completion_ids):
    return reward.fn(prompts=prompts, completions=completions,
                     completion_ids=completion_ids, **columns)


def _failing_prompt(reward: Reward, prompts, completions, columns, completion_ids) -> int:
    """The first completion the function raises on alone (0 if it raises only on the
    batch), so that its error names a prompt."""
    for i in range(len(prompts)):
        one = {k: v[i:i + 1] for k, v in columns.items()}
        try:
            _call(reward, prompts[i:i + 1], completions[i:i + 1], one, completion_ids[i:i + 1])
        except Exception:  # noqa: BLE001 - any error the user's function raises
            return i
    return 0


def _values(reward: Reward, prompts, completions, columns, completion_ids) -> np.ndarray:
    n = len(prompts)
    try:
        out = _call(reward, prompts, completions, columns, completion_ids)
    except RewardError:
        raise
    except Exception as e:  # noqa: BLE001 - any error the user's function raises
        i = _failing_prompt(reward, prompts, completions, columns, completion_ids)
        said = str(e).splitlines()[0] if str(e) else ""
        raise RewardError(f"reward function {reward.name!r} raised {type(e).__name__}: "
                          f"{said} (prompt {i}: {_shown(prompts[i])})") from None
    if not isinstance(out, (list, tuple, np.ndarray)) or len(out) != n:
        got = f"{len(out)} rewards" if isinstance(out, (list, tuple, np.ndarray)) \
            else f"a {type(out).__name__}"
        raise RewardError(f"reward function {reward.name!r} returned {got} for {n} "
                          f"completions (prompt 0: {_shown(prompts[0])}): it must return "
                          f"one float or None per completion")
    values = np.full(n, np.nan, np.float32)
    for i, value in enumerate(out):
        if value is None:
            continue
        try:
            values[i] = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward function {reward.name!r} returned {value!r} (prompt {i}: "
                              f"{_shown(prompts[i])}): rewards are floats or None") from None
    return values


def score(rewards: Sequence[Reward], prompts, completions, completion_ids, columns: dict
          ) -> tuple[np.ndarray, dict]:
    """([N, F] float32 rewards, NaN where a function returned None; TRL's per-function
    metrics rewards/NAME/mean and /std) of N completions, prompts repeated per completion,
    columns: the dataset's extra columns, one value per completion."""
    values_FN = np.stack([_values(r, list(prompts), list(completions), columns,
                                  list(completion_ids)) for r in rewards])
    metrics = {}
    for r, v in zip(rewards, values_FN):
        label = _label(r.name)
        metrics[f"rewards/{label}/mean"] = float(nanmean(v))
        metrics[f"rewards/{label}/std"] = float(nanstd(v))
    return values_FN.T, metrics


def _label(name: str) -> str:
    """A metric-safe label: a built-in's name, or a user function's own name."""
    return name.rpartition(":")[2]
