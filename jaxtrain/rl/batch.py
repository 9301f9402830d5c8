"""The engine's rollouts (token-id lists) and their texts -> one Rollouts batch, on the
host: rewards scored, advantages computed, prompts left-padded and completions
right-padded as TRL pads them, truncated completions masked (DAPO), and the step's token
count. Sampling-time and reference log-probabilities, where needed, are filled in on the
device afterwards (objective.rollout_logps), or taken from the engine."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxtrain.errors import DataError
from jaxtrain.rl.advantages import group_advantages, weighted_rewards
from jaxtrain.rl.objective import Rollouts
from jaxtrain.rl.rewards import Reward, score


def padded(rows: Sequence[Sequence[int]], width: int, pad_id: int, left: bool
           ) -> tuple[np.ndarray, np.ndarray]:
    """(int32 [N, width] ids, int32 [N, width] mask of the real tokens): each row padded
    with pad_id on the left (prompts) or the right (completions)."""
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        n = len(row)
        at = slice(width - n, width) if left else slice(0, n)
        ids[i, at], mask[i, at] = row, 1
    return ids, mask


def rollout_batch(prompt_ids, completion_ids, advantages_N, pad_id: int, stop_ids=(),
                  mask_truncated: bool = False, prompt_width: int | None = None,
                  completion_width: int | None = None) -> Rollouts:
    """Rollouts of N completions (old_logps and ref_logps None: on-policy and no reference
    log-probs; fill them in with rollout_logps where needed).
    Widths default to the longest row (give fixed ones to keep one compiled shape);
    mask_truncated: zero the mask of completions whose last token is not in stop_ids
    (TRL's mask_truncated_completions: the EOS ids, and pad_id)."""
    p_width = prompt_width or max(len(p) for p in prompt_ids)
    c_width = completion_width or max(max(len(c) for c in completion_ids), 1)
    for what, rows, width in (("prompt", prompt_ids, p_width),
                              ("completion", completion_ids, c_width)):
        longest = max(len(row) for row in rows)
        if longest > width:
            raise DataError(f"a {what} of {longest} tokens does not fit the {what} width "
                            f"{width} of the rollout batch")
    prompts, prompt_mask = padded(prompt_ids, p_width, pad_id, left=True)
    completions, mask = padded(completion_ids, c_width, pad_id, left=False)
    if mask_truncated:
        stops = set(stop_ids) | {pad_id}
        cut_N = np.asarray([len(c) == 0 or c[-1] not in stops for c in completion_ids])
        mask = mask * ~cut_N[:, None]
    return Rollouts(np.concatenate([prompts, completions], 1), prompt_mask, mask,
                    np.asarray(advantages_N, np.float32),
                    np.full(len(mask), mask.sum(), np.float32))


def rollout_advantages(rewards: Sequence[Reward], prompts, completions, completion_ids,
                       columns: dict, num_generations: int, scale_rewards: str = "group"
                       ) -> tuple[np.ndarray, dict]:
    """([N] advantages, TRL's reward metrics) of N completions in groups of
    num_generations: rewards.score, then the weighted sum and group_advantages."""
    values_NF, metrics = score(rewards, prompts, completions, completion_ids, columns)
    rewards_N = weighted_rewards(values_NF, [r.weight for r in rewards])
    advantages_N, reward_metrics = group_advantages(rewards_N, num_generations, scale_rewards)
    return advantages_N, {**metrics, **reward_metrics}
