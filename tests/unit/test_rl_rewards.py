"""Reward functions (jaxtrain/rl/rewards.py): the built-ins (the format and overlong ones
against TRL's own), a user function by import path, one batch scored into [N, F] with
None as NaN, the one-line refusals naming the function and the prompt; DAPO's dynamic
sampling."""

import numpy as np
import pytest

from jaxtrain.errors import ConfigError, JaxtrainError
from jaxtrain.rl.advantages import varied_groups
from jaxtrain.rl.rewards import RewardError, build_rewards, final_answer, score


def length_reward(prompts, completions, **kwargs):
    """A user reward, imported as 'test_rl_rewards:length_reward'."""
    return [float(len(c)) for c in completions]


def picky_reward(prompts, completions, **kwargs):
    if any("boom" in p for p in prompts):
        raise ValueError("cannot score this\nsecond line")
    return [1.0] * len(prompts)


def short_reward(prompts, completions, **kwargs):
    return [1.0]


def text_reward(prompts, completions, **kwargs):
    return ["high"] * len(prompts)


def _score(entries, prompts, completions, ids=None, **columns):
    ids = ids if ids is not None else [[1] * len(str(c)) for c in completions]
    return score(build_rewards(entries), prompts, completions, ids, columns)


def test_final_answers_boxed_hashes_and_a_pattern():
    assert final_answer(r"so \boxed{\frac{1}{2}} then \boxed{x^{2}}") == "x^{2}"
    assert final_answer("work...\n#### 1,234\nmore") == "1,234"
    assert final_answer("The answer is 7.", r"answer is (\d+)") == "7"
    assert final_answer("no answer here") is None


def test_answer_reward_matches_the_final_answer():
    completions = [r"thus \boxed{72}", "#### 72.0", "it is 71\n#### 71",
                   [{"role": "assistant", "content": "#### $1,000."}], "nothing", "#### 5"]
    answers = ["Natalia sold ... #### 72", "72", "72", "1000", "3", None]
    rewards, metrics = _score([{"name": "answer"}], ["q"] * 6, completions, answer=answers)
    np.testing.assert_array_equal(rewards[:, 0], [1, 1, 0, 1, 0, np.nan])
    assert metrics["rewards/answer/mean"] == pytest.approx(0.6)
    pattern = [{"name": "answer", "column": "gold", "pattern": r"ANSWER: (\w+)"}]
    rewards, _ = _score(pattern, ["q"] * 2, ["ANSWER: cat", r"\boxed{cat}"], gold=["cat"] * 2)
    np.testing.assert_array_equal(rewards[:, 0], [1, 0])


def test_format_and_overlong_equal_trl():
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    texts = ["<think>\nreason\n</think>\nanswer", "<think>a</think><think>b</think>x",
             "no think", "<think>open only"]
    rewards, _ = _score([{"name": "format"}], ["q"] * 4, texts)
    theirs = think_format_reward([[{"content": t}] for t in texts])
    np.testing.assert_array_equal(rewards[:, 0], theirs)
    rewards, _ = _score([{"name": "format", "pattern": r"^\d+$"}], ["q"] * 2, ["42", "4 2"])
    np.testing.assert_array_equal(rewards[:, 0], [1, 0])
    ids = [[1] * n for n in (10, 80, 81, 90, 100, 101, 150)]
    rewards, _ = _score([{"name": "overlong", "max_completion_len": 100,
                          "soft_punish_cache": 20}], ["q"] * 7, ["c"] * 7, ids)
    trl_fn = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    np.testing.assert_allclose(rewards[:, 0], trl_fn(ids), rtol=1e-6)
    assert rewards[3, 0] == pytest.approx(-0.5)


def test_a_user_function_by_import_path_with_its_weight():
    rewards = build_rewards([{"name": "test_rl_rewards:length_reward", "weight": 0.5},
                             {"name": "format", "weight": 2.0}])
    assert [r.weight for r in rewards] == [0.5, 2.0]
    values, metrics = score(rewards, ["p", "p"], ["abc", "<think>x</think>y"], [[1], [2]], {})
    np.testing.assert_array_equal(values, [[3, 0], [17, 1]])
    assert metrics["rewards/length_reward/mean"] == 10.0


@pytest.mark.parametrize("entry, says", [
    ({"name": "nope"}, r"train.grpo.rewards\[0\].name=.nope. is invalid: valid values are"),
    ({"name": "no_such_module:f"}, "cannot import it"),
    ({"name": "test_rl_rewards:missing"}, "cannot import it"),
    ({"name": "answer", "colum": "x"}, r"train.grpo.rewards\[0\] \(answer\) options"),
    ({"name": "overlong"}, "options"),
])
def test_config_refusals_are_one_line(entry, says):
    with pytest.raises(ConfigError, match=says) as e:
        build_rewards([entry])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, says", [
    ("picky_reward", "reward function 'test_rl_rewards:picky_reward' raised ValueError: "
                     "cannot score this (prompt 2: 'boom here')"),
    ("short_reward", "'test_rl_rewards:short_reward' returned 1 rewards for 4 completions "
                     "(prompt 0: 'fine'"),
    ("text_reward", "'test_rl_rewards:text_reward' returned 'high' (prompt 0: 'fine')"),
])
def test_a_failing_reward_function_is_named_with_its_prompt_in_one_line(name, says):
    prompts = ["fine", "fine", "boom here", "boom again"]
    with pytest.raises(RewardError) as e:
        _score([{"name": f"test_rl_rewards:{name}"}], prompts, ["c"] * 4)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, JaxtrainError)
    with pytest.raises(RewardError, match="needs the dataset column 'answer'") as e:
        _score([{"name": "answer"}], ["q"], ["c"])


def test_dynamic_sampling_drops_groups_of_equal_rewards():
    nan = np.nan
    rewards = [1, 0, 1, 1,  2, 2, 2, 2,  nan, 1, nan, nan,  nan, 0, 0, 3]
    keep = varied_groups(np.asarray(rewards, np.float32), 4)
    assert keep.tolist() == [True] * 4 + [False] * 8 + [True] * 4
