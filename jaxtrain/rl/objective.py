"""A batch of scored rollouts and the GRPO family's loss on it: what train.objective=grpo's
step minimises, once the engine's rollouts and the rewards' advantages are laid out here.

A row is [prompt | completion]: the prompt left-padded to P, the completion right-padded
to T (the engine's max_new_tokens), as TRL lays them out. Everything per row is in
`Rollouts`, a pytree whose leaves all have the batch first, so that a step shards it like
a token batch (shard_rollouts) and micro-batches split it by rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.rl.logps import completion_logps, rollout_layout
from jaxtrain.rl.loss import LossSettings, grpo_loss


class Rollouts(NamedTuple):
    """One batch of B scored completions (B = prompts · num_generations)."""

    ids: jax.Array  # int32 [B, P + T]: left-padded prompt, right-padded completion
    prompt_mask: jax.Array  # int32 [B, P]: 1 on the prompt's tokens
    completion_mask: jax.Array  # int32 [B, T]: the tokens the loss counts (truncation_mask'd)
    advantages: jax.Array  # float32 [B] (advantages.group_advantages)
    # float32 [B]: the step's active-token count over all its rows (all micro-batches),
    # repeated per row: dapo and cispo divide by it (TRL's num_items_in_batch)
    num_items: jax.Array
    # float32 [B, T]: the policy's at sampling time (the engine's, or rollout_logps at the
    # step that sampled them); None: on-policy, the policy's own without gradient (TRL
    # with num_iterations=1, where old == current), no extra forward pass
    old_logps: jax.Array | None = None
    # float32 [B, T]: the reference's, computed at rollout time (rollout_logps); None: the
    # loss computes them from the reference parameters (grpo_objective's `reference`), or
    # beta is 0
    ref_logps: jax.Array | None = None


def _scores(params, graphdef, r: Rollouts, temperature: float):
    """([B, T] log-probs, [B, T] entropies, MoE penalty or None, metrics) of the rows."""
    width = r.completion_mask.shape[1]
    segments, positions = rollout_layout(r.prompt_mask, r.completion_mask)
    return completion_logps(params, graphdef, r.ids, width, segments, positions, temperature)


def rollout_logps(params: dict, graphdef: nnx.GraphDef, rollouts: Rollouts,
                  temperature: float = 1.0) -> jax.Array:
    """[B, T] log-probabilities of the completions without gradient: the sampling-time
    policy's (old_logps: the engine's own, or this at the step that sampled them) or the
    reference's (ref_logps), 0 where the completion mask is 0 (as TRL pads them)."""
    logp_BT = _scores(jax.lax.stop_gradient(params), graphdef, rollouts, temperature)[0]
    return jax.lax.stop_gradient(logp_BT) * rollouts.completion_mask


def grpo_objective(params: dict, graphdef: nnx.GraphDef, rollouts: Rollouts,
                   settings: LossSettings, temperature: float = 1.0, reference=None,
                   reference_graphdef: nnx.GraphDef | None = None, microbatches: int = 1
                   ) -> tuple[jax.Array, dict]:
    """(the loss plus an MoE model's router losses, metrics: `loss` the policy loss when a
    penalty is added, TRL's names otherwise). With settings.beta > 0 and `reference`
    given (LoRA's frozen base or the frozen copy), the reference's log-probabilities are
    computed here under stop_gradient; without it, rollouts.ref_logps are used (the loss
    refuses None then).

    microbatches: how many micro-batches of equal rows the step averages (rows: every
    loss type's micro-batches weigh equally, as TRL's accumulation). dapo and cispo then
    divide each by num_items / microbatches, so that their mean is the step's sum over
    its active tokens (TRL: each micro-batch's sum over the generation batch's count)."""
    logp_BT, entropy_BT, penalty, metrics = _scores(params, graphdef, rollouts, temperature)
    ref_BT = rollouts.ref_logps
    if settings.beta != 0.0 and reference is not None:
        ref_BT = rollout_logps(reference, reference_graphdef, rollouts, temperature)
    loss, rl_metrics = grpo_loss(
        logp_BT, rollouts.old_logps, ref_BT, rollouts.completion_mask, rollouts.advantages,
        settings, num_items=rollouts.num_items[0] / microbatches, entropy_BT=entropy_BT)
    if penalty is None:
        return loss, {**rl_metrics, **metrics}
    return loss + penalty, {"loss": loss, **rl_metrics, **metrics}


def shard_rollouts(rollouts: Rollouts, tokens_sharding: NamedSharding) -> Rollouts:
    """The rows of a (host) Rollouts batch as global arrays, each leaf's batch axis sharded
    as the step's token batches are (its other axes replicated). With several processes,
    every one gives the whole batch."""
    batch_axes = tokens_sharding.spec[0]

    def put(x):
        spec = PartitionSpec(batch_axes, *([None] * (jnp.ndim(x) - 1)))
        sharding = NamedSharding(tokens_sharding.mesh, spec)
        if jax.process_count() == 1:
            return jax.make_array_from_process_local_data(sharding, x)
        # Every process holds the whole batch (each sampled all of it): each takes the
        # rows of its own devices.
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree.map(put, rollouts)
