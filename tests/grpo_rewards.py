"""User reward functions (train.grpo.rewards='grpo_rewards:NAME') for tests/e2e/test_grpo_train.py:
importable by the CLI runs it starts (tests/ on their PYTHONPATH)."""

import os


def digits(prompts, completions, **columns):
    """The share of a completion's characters that are digits: it varies between a random
    model's samples, so the advantages (and the loss) are not all zero."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def fails_when_flagged(prompts, completions, **columns):
    """Raises while $GRPO_TEST_FAIL names a file that exists; 0 otherwise."""
    flag = os.environ.get("GRPO_TEST_FAIL", "")
    if flag and os.path.exists(flag):
        raise ValueError("no reward for this one")
    return [0.0 for _ in completions]
