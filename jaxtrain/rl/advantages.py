"""Rewards into advantages, as TRL's GRPOTrainer does (_generate_and_score_completions,
multi_objective_aggregation='sum_then_normalize'), on the host in float32 numpy: rewards
come from Python functions, one value per completion.

Completions arrive in groups of `num_generations` consecutive rows, one group per prompt.
A completion's reward is the weighted sum of its reward functions' values, a None (NaN)
counting as nothing (nansum); a completion that every function left unscored is NaN, kept
out of its group's mean and std, and gets advantage 0. advantage = reward - group mean,
divided by (std + 1e-4) unless scale_rewards='none'; the std is the group's or, with
'batch', the whole batch's, Bessel-corrected over the scored values (TRL's nanstd).
"""

from __future__ import annotations

import numpy as np

from jaxtrain.errors import fail

SCALES = ("group", "batch", "none")
# TRL's guard in the division by the std (not an epsilon of the std itself): a group of
# equal rewards gets advantages 0, not NaN.
STD_EPS = 1e-4


def nanmean(x, axis=None, keepdims=False):
    """numpy's nanmean without its warning: NaN where nothing is scored."""
    scored = ~np.isnan(x)
    count = scored.sum(axis=axis, keepdims=keepdims)
    total = np.where(scored, x, 0).sum(axis=axis, keepdims=keepdims)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan).astype(x.dtype)


def nanstd(x, axis=None, keepdims=False):
    """TRL's nanstd: the Bessel-corrected std of the non-NaN values; NaN with fewer than 2."""
    mean = nanmean(x, axis=axis, keepdims=True)
    variance = nanmean((x - mean) ** 2, axis=axis, keepdims=keepdims)
    count = (~np.isnan(x)).sum(axis=axis, keepdims=keepdims)
    with np.errstate(invalid="ignore", divide="ignore"):
        correction = np.where(count > 1, count / (count - 1), np.nan)
    return np.sqrt(variance * correction).astype(x.dtype)


def weighted_rewards(rewards_NF, weights_F) -> np.ndarray:
    """[N] float32: each completion's weighted sum over its reward functions (NaN values,
    TRL's None, count as nothing); NaN where every function returned None."""
    rewards_NF = np.asarray(rewards_NF, np.float32)
    weights_F = np.asarray(weights_F, np.float32)
    total_N = np.where(np.isnan(rewards_NF), 0, rewards_NF * weights_F).sum(axis=1)
    return np.where(np.isnan(rewards_NF).all(axis=1), np.nan, total_N).astype(np.float32)


def group_advantages(rewards_N, num_generations: int, scale_rewards: str = "group"
                     ) -> tuple[np.ndarray, dict]:
    """([N] float32 advantages, TRL's logged reward metrics) of rewards in consecutive
    groups of num_generations (NaN: unscored, advantage 0)."""
    if scale_rewards not in SCALES:
        fail("train.grpo.scale_rewards", scale_rewards, "valid values are group, batch, none")
    rewards_N = np.asarray(rewards_N, np.float32)
    if num_generations < 1 or rewards_N.size % num_generations:
        fail("train.grpo.num_generations", num_generations,
             f"it must divide the {rewards_N.size} completions of the batch")
    grouped_GK = rewards_N.reshape(-1, num_generations)
    mean_N = np.repeat(nanmean(grouped_GK, axis=1), num_generations)
    if scale_rewards == "batch":
        std_N = np.full_like(rewards_N, nanstd(rewards_N) if rewards_N.size > 1 else 0.0)
    elif num_generations > 1:  # 'none' keeps the group std for the zero-std metric only
        std_N = np.repeat(nanstd(grouped_GK, axis=1), num_generations)
    else:
        std_N = np.zeros_like(rewards_N)
    advantages_N = rewards_N - mean_N
    if scale_rewards != "none":
        advantages_N = advantages_N / (std_N + np.float32(STD_EPS))
    zero_std_N = np.abs(std_N) <= 1e-8  # torch.isclose(std, 0): atol 1e-8, NaN is not close
    metrics = {"reward": float(nanmean(rewards_N)), "reward_std": float(nanstd(rewards_N)),
               "frac_reward_zero_std": float(zero_std_N.mean())}
    return np.nan_to_num(advantages_N, nan=0.0).astype(np.float32), metrics


def varied_groups(rewards_N, num_generations: int) -> np.ndarray:
    """[N] bool: DAPO's dynamic sampling, the completions to keep: those of groups whose
    scored rewards are not all equal (a group of equal rewards has advantages 0 and teaches
    nothing, yet would dilute the batch's token normalisation). A group with fewer than two
    scored completions is dropped too: its advantages are 0 as well."""
    grouped_GK = np.asarray(rewards_N, np.float32).reshape(-1, num_generations)
    scored_GK = ~np.isnan(grouped_GK)
    high = np.where(scored_GK, grouped_GK, -np.inf).max(axis=1)
    low = np.where(scored_GK, grouped_GK, np.inf).min(axis=1)
    keep_G = (scored_GK.sum(axis=1) >= 2) & (high > low)
    return np.repeat(keep_G, num_generations)
