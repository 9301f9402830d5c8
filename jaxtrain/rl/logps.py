"""Per-token log-probabilities (and entropies) of completions under a model: what the GRPO
loss takes for the policy, and, once per rollout without gradient, for the sampling-time
and reference policies.

A rollout row is [prompt | completion]: S = P + T tokens, the completion's T scored (TRL's
logits_to_keep). The head runs only over those T positions, in sequence chunks like the
DPO objective's token_logprobs (models/head_loss.py), so no more than a chunk's logits
exist at once; each chunk also gives the entropy of its distributions (TRL's `entropy`
metric) at the cost of one more reduction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import fail
from jaxtrain.mesh import constrain
from jaxtrain.models.head_loss import (
    _head_axes,
    _split,
    _unsplit,
    length_shards,
    logits_chunk,
    soft_cap,
)


def completion_logps(params: dict, graphdef: nnx.GraphDef, ids_BS, completion_len: int,
                     segments_BS=None, positions_BS=None, temperature: float = 1.0):
    """([B, T] log p(completion token), [B, T] entropy (no gradient), MoE penalty or None,
    routing metrics) of rows ids_BS = [prompt | completion], T = completion_len.
    segments_BS / positions_BS: rollout_layout's, where prompts are left-padded;
    temperature: the sampling temperature the logits are divided by (TRL's)."""
    model = nnx.merge(graphdef, params)
    if model.spec.context is not None:  # its rows would need the zig-zag layout (not here)
        fail("mesh.context", model.spec.context.size, "RL rollouts are scored in their own "
             "order: train.objective=grpo runs with mesh.context=1 for now")
    head, vocab_major = model.head_as_stored()
    inputs_BL, targets_BL = ids_BS[:, :-1], ids_BS[:, 1:]
    documents = () if segments_BS is None else (segments_BS[:, :-1], positions_BS[:, :-1])
    features_BLD, penalty, metrics = model.features_and_aux(inputs_BL, *documents)
    # the position before each completion token predicts it
    scores = token_scores(features_BLD[:, -completion_len:], head, targets_BL[:, -completion_len:],
                          model.spec.rules, vocab_major, model.spec.final_softcap, temperature)
    return scores[0], jax.lax.stop_gradient(scores[1]), penalty, metrics


def token_scores(x_BLD, head, targets_BL, rules=(), vocab_major: bool = False,
                 cap: float = 0.0, temperature: float = 1.0):
    """([B, L] log softmax(logits / temperature)[target], [B, L] entropy of that softmax),
    float32, over head_loss's sequence chunks; each chunk's logits recomputed in the
    backward pass rather than kept."""
    head_axes = _head_axes(vocab_major)
    shards = length_shards(rules)
    strided = shards > 1
    chunk = logits_chunk(x_BLD.shape[1], x_BLD.shape[0], shards)

    @jax.checkpoint
    def chunk_scores(x_BCD, targets_BC):
        logits_BCV = jnp.einsum(f"bcd,{head_axes}->bcv", x_BCD, head).astype(jnp.float32)
        logits_BCV = soft_cap(constrain(logits_BCV, ("batch", "length", "vocab"), rules), cap)
        if temperature != 1.0:
            logits_BCV = logits_BCV / temperature
        logz_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
        target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
        probs_BCV = jnp.exp(logits_BCV - logz_BC[..., None])
        entropy_BC = logz_BC - (probs_BCV * logits_BCV).sum(-1)
        return target_BC - logz_BC, entropy_BC

    def body(_, xs_chunk):
        return None, chunk_scores(*xs_chunk)

    xs = (_split(x_BLD, chunk, strided), _split(targets_BL, chunk, strided))
    _, (logp_CBc, entropy_CBc) = jax.lax.scan(body, None, xs)
    return _unsplit(logp_CBc, strided), _unsplit(entropy_CBc, strided)


def rollout_layout(prompt_mask_BP, completion_mask_BT):
    """(segments, positions) [B, P + T] int32 of rows of left-padded prompts and
    right-padded completions: 1 on the real tokens and 0 on the padding, which no real
    token attends to; positions count from each row's first real token (as the engine
    generated them), not from the row's start."""
    mask_BS = jnp.concatenate([prompt_mask_BP, completion_mask_BT], axis=1).astype(jnp.int32)
    positions_BS = jnp.maximum(jnp.cumsum(mask_BS, axis=1) - 1, 0)
    return mask_BS, positions_BS.astype(jnp.int32)
