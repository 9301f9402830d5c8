"""The GRPO family's loss on [B, T] per-token log-probabilities, as TRL 1.16's
GRPOTrainer._compute_loss computes it (one process, one micro-batch: the whole batch).

Per token, with ratio r = exp(logp - old_logp) (old: the sampling-time policy's) and the
completion's advantage A:
- grpo, bnpo, dr_grpo, dapo: −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), r first capped
  at `delta` when set (INTELLECT-2's two-sided clip);
- cispo: −sg(min(r, ε_high))·A·logp (ε_high is then the ratio's cap itself, ~5);
- sapo: −σ(τ·(r − 1))·4/τ·A, τ = sapo_temperature_pos where A > 0 else _neg (a soft
  gate instead of the clip: SAPO).
With importance_sampling_level='sequence' (GSPO) r is one per completion: exp of the
masked mean of the log-ratios. With beta > 0 the k3 estimate of KL(π‖π_ref),
exp(ref − logp) − (ref − logp) − 1, times r when kl_bias_correction (TRL's
use_bias_correction_kl, default on), is added per token times beta.

Normalisations over the completion mask M:
- grpo: each completion's mean over its tokens, then the mean over completions;
- bnpo: the sum over the batch / the batch's token count;
- dr_grpo: the sum / (B · max_completion_length), a constant;
- dapo, cispo: the sum / the active tokens of the global batch (`num_items`; by default
  this batch's own count: pass the whole step's when this batch is one micro-batch of it);
- sapo: as grpo; luspo: each completion's sum (its length times its mean: LUSPO, meant
  with importance_sampling_level='sequence'), then the mean over completions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxtrain.errors import fail

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
LEVELS = ("token", "sequence")
# the PPO-style clip (cispo caps the ratio instead, sapo gates it softly)
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """A loss's static settings (TRL GRPOConfig's names), checked on construction."""
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (TRL); DAPO's clip-higher: 0.28
    beta: float = 0.0
    importance_sampling_level: str = "token"
    delta: float | None = None
    kl_bias_correction: bool = True
    max_completion_length: int | None = None  # dr_grpo's constant
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    def __post_init__(self):
        key = "train.grpo"
        if self.loss_type not in LOSS_TYPES:
            fail(f"{key}.loss_type", self.loss_type, f"valid values are {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in LEVELS:
            fail(f"{key}.importance_sampling_level", self.importance_sampling_level,
                 "valid values are token, sequence (GSPO)")
        if self.epsilon < 0 or self.high < 0:
            fail(f"{key}.epsilon", (self.epsilon, self.epsilon_high), "clip widths are >= 0")
        if self.beta < 0:
            fail(f"{key}.beta", self.beta, "the KL coefficient is >= 0 (0: no reference)")
        if min(self.sapo_temperature_pos, self.sapo_temperature_neg) <= 0:
            fail(f"{key}.sapo_temperature_pos",
                 (self.sapo_temperature_pos, self.sapo_temperature_neg),
                 "sapo's gate temperatures (pos, neg) are > 0")
        if self.loss_type == "dr_grpo" and not (self.max_completion_length or 0) > 0:
            fail(f"{key}.max_completion_length", self.max_completion_length,
                 "loss_type='dr_grpo' divides by batch · max_completion_length: give it (> 0)")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def grpo_loss(logp_BT, old_logp_BT, ref_logp_BT, mask_BT, advantages_B,
              settings: LossSettings, num_items=None, entropy_BT=None
              ) -> tuple[jax.Array, dict]:
    """(loss, TRL's metrics) of one batch of completions. logp_BT: the policy's per-token
    log-probabilities (differentiated); old_logp_BT: at sampling time, or None for
    on-policy (logp itself, no gradient); ref_logp_BT: the reference's, needed when
    settings.beta > 0; mask_BT: the completion tokens that count; advantages_B: one per
    completion; entropy_BT: the policy's per-token entropy, for the metric only."""
    s = settings
    mask_BT = mask_BT.astype(jnp.float32)
    old_logp_BT = jax.lax.stop_gradient(logp_BT) if old_logp_BT is None else old_logp_BT
    log_ratio_BT = logp_BT - old_logp_BT
    if s.importance_sampling_level == "sequence":  # GSPO: one ratio per completion [B, 1]
        log_ratio_BT = ((log_ratio_BT * mask_BT).sum(-1, keepdims=True)
                        / jnp.maximum(mask_BT.sum(-1, keepdims=True), 1.0))
    ratio_BT = jnp.exp(log_ratio_BT)  # [B, T], or [B, 1] per sequence
    advantages_B1 = advantages_B.astype(jnp.float32)[:, None]
    per_token_BT = _surrogate(ratio_BT, advantages_B1, logp_BT, s)
    kl_BT = None
    if s.beta != 0.0:
        if ref_logp_BT is None:
            fail("train.grpo.beta", s.beta, "a KL penalty needs the reference's log-probs: "
                 "give them, or a reference to compute them (or beta=0)")
        delta_BT = ref_logp_BT - logp_BT
        kl_BT = jnp.exp(delta_BT) - delta_BT - 1
        if s.kl_bias_correction:  # the unbiased reverse-KL gradient (DeepSeek-V3.2)
            kl_BT = kl_BT * ratio_BT
        per_token_BT = per_token_BT + s.beta * kl_BT
    loss = _normalised(per_token_BT * mask_BT, mask_BT, s, num_items)
    if s.delta is not None and s.loss_type in CLIPPED:  # TRL counts clips of the capped ratio
        ratio_BT = jnp.minimum(ratio_BT, s.delta)
    return loss, _metrics(ratio_BT, advantages_B1, mask_BT, kl_BT, entropy_BT, s)


def _surrogate(ratio_BT, advantages_B1, logp_BT, s: LossSettings):
    """The per-token policy loss before masking ([B, T] or, per sequence, [B, 1])."""
    if s.loss_type == "cispo":  # REINFORCE on logp, weighted by the capped, frozen ratio
        capped_BT = jax.lax.stop_gradient(jnp.minimum(ratio_BT, s.high))
        return -capped_BT * advantages_B1 * logp_BT
    if s.loss_type == "sapo":
        tau_B1 = jnp.where(advantages_B1 > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        return -jax.nn.sigmoid(tau_B1 * (ratio_BT - 1)) * 4 / tau_B1 * advantages_B1
    clipped_BT = jnp.clip(ratio_BT, 1 - s.epsilon, 1 + s.high)
    if s.delta is not None:  # the unclipped side capped too (after the clip is taken)
        ratio_BT = jnp.minimum(ratio_BT, s.delta)
    return -jnp.minimum(ratio_BT * advantages_B1, clipped_BT * advantages_B1)


def _normalised(masked_BT, mask_BT, s: LossSettings, num_items):
    if s.loss_type in ("grpo", "sapo"):
        return (masked_BT.sum(-1) / jnp.maximum(mask_BT.sum(-1), 1.0)).mean()
    if s.loss_type == "luspo":
        return masked_BT.sum(-1).mean()
    if s.loss_type == "bnpo":
        return masked_BT.sum() / jnp.maximum(mask_BT.sum(), 1.0)
    if s.loss_type == "dr_grpo":
        return masked_BT.sum() / (masked_BT.shape[0] * s.max_completion_length)
    items = mask_BT.sum() if num_items is None else jnp.asarray(num_items, jnp.float32)
    return masked_BT.sum() / jnp.maximum(items, 1.0)  # dapo, cispo


def _metrics(ratio_BT, advantages_B1, mask_BT, kl_BT, entropy_BT, s: LossSettings) -> dict:
    """TRL's names and values: global masked means over the batch's completion tokens (or
    over completions, for a per-sequence ratio), and the extremes of per-completion means."""
    def global_mean(x_BT):
        if x_BT.shape[1] == 1:
            return x_BT.sum() / x_BT.shape[0]
        return (x_BT * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1.0)

    def per_completion(x_BT):  # NaN for an empty completion, as TRL's (nanmin skips it)
        if x_BT.shape[1] == 1:
            return x_BT[:, 0]
        return (x_BT * mask_BT).sum(-1) / mask_BT.sum(-1)

    metrics = {}
    if kl_BT is not None:
        metrics["kl"] = global_mean(jax.lax.stop_gradient(kl_BT))
    if entropy_BT is not None:
        metrics["entropy"] = global_mean(jax.lax.stop_gradient(entropy_BT))
    ratio_BT = jax.lax.stop_gradient(ratio_BT)
    if s.loss_type == "sapo":  # no clip to count
        return metrics
    if s.loss_type == "cispo":
        capped = (ratio_BT > s.high) & (advantages_B1 > 0)
        metrics["cispo_clip_ratio"] = global_mean(capped.astype(jnp.float32))
        return metrics
    low = ((ratio_BT < 1 - s.epsilon) & (advantages_B1 < 0)).astype(jnp.float32)
    high = ((ratio_BT > 1 + s.high) & (advantages_B1 > 0)).astype(jnp.float32)
    metrics["clip_ratio/low_mean"] = global_mean(low)
    metrics["clip_ratio/high_mean"] = global_mean(high)
    metrics["clip_ratio/region_mean"] = global_mean(jnp.maximum(low, high))
    metrics["clip_ratio/low_min"] = jnp.nanmin(per_completion(low))
    metrics["clip_ratio/high_max"] = jnp.nanmax(per_completion(high))
    return metrics


def truncation_mask(completion_ids_BT, mask_BT, stop_ids) -> jax.Array:
    """mask_BT with the rows of truncated completions zeroed (TRL's
    mask_truncated_completions, DAPO): a completion is truncated when its last token
    (the last under mask_BT) is none of stop_ids (the EOS ids and the pad id), i.e. the
    length limit ended it and its reward judged a cut-off text."""
    length_B = mask_BT.astype(jnp.int32).sum(-1)
    last_B = jnp.take_along_axis(completion_ids_BT, jnp.maximum(length_B - 1, 0)[:, None],
                                 axis=-1)[:, 0]
    stopped_B = jnp.isin(last_B, jnp.asarray(list(stop_ids), completion_ids_BT.dtype))
    return mask_BT * stopped_B[:, None].astype(mask_BT.dtype)
