"""The next token of every slot, each row with its own sampling parameters and seed, and
its log-probability: traced inside the engine's decode step (engine/steps.py).

A row at temperature 0 takes the argmax. Otherwise its logits are divided by the
temperature and cut as transformers cuts them, in its order: top-k, then top-p (the
smallest set of most likely tokens holding that mass of what top-k kept), then min-p (tokens
under min_p times the most likely one's probability); one draw from what is left. Each
row's key is its request's seed folded with the sample's index and the token's index, so a
request draws the same tokens whatever shares the batch with it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters, [S] each (a pytree: jit takes it as arrays)."""

    temperature_S: jax.Array  # float32; 0: greedy
    top_k_S: jax.Array  # int32; 0: off
    top_p_S: jax.Array  # float32; 1: off
    min_p_S: jax.Array  # float32; 0: off
    seed_S: jax.Array  # uint32: the request's seed
    sample_S: jax.Array  # int32: which of the request's n samples
    index_S: jax.Array  # int32: which new token of the sample this draw is


jax.tree_util.register_dataclass(
    RowSampling, data_fields=[f.name for f in dataclasses.fields(RowSampling)], meta_fields=[])


def _row_key(seed, sample, index):
    key = jax.random.fold_in(jax.random.key(0), seed)
    return jax.random.fold_in(jax.random.fold_in(key, sample), index)


def _cut(logits_SV: jax.Array, rows: RowSampling) -> jax.Array:
    """Tempered logits with every token outside a row's top-k / top-p / min-p at -inf."""
    temperature_S1 = jnp.where(rows.temperature_S > 0, rows.temperature_S, 1.0)[:, None]
    scaled_SV = logits_SV / temperature_S1
    sorted_SV = -jnp.sort(-scaled_SV, axis=-1)  # descending
    rank_V = jnp.arange(scaled_SV.shape[-1])
    k_S1 = jnp.where(rows.top_k_S > 0, rows.top_k_S, scaled_SV.shape[-1])[:, None]
    in_k_SV = rank_V[None, :] < k_S1
    probs_SV = jax.nn.softmax(jnp.where(in_k_SV, sorted_SV, -jnp.inf), axis=-1)
    before_SV = jnp.cumsum(probs_SV, axis=-1) - probs_SV  # mass of the likelier tokens
    keep_SV = in_k_SV & (before_SV < rows.top_p_S[:, None]) \
        & (probs_SV >= rows.min_p_S[:, None] * probs_SV[:, :1])
    keep_SV = keep_SV.at[:, 0].set(True)  # the most likely token always stays
    cutoff_S1 = jnp.min(jnp.where(keep_SV, sorted_SV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled_SV < cutoff_S1, -jnp.inf, scaled_SV)


def _draw(logits_SV: jax.Array, rows: RowSampling) -> jax.Array:
    keys_S = jax.vmap(_row_key)(rows.seed_S, rows.sample_S, rows.index_S)
    drawn_S = jax.vmap(lambda k, l_V: jax.random.categorical(k, l_V))(keys_S,
                                                                      _cut(logits_SV, rows))
    greedy_S = jnp.argmax(logits_SV, axis=-1)
    return jnp.where(rows.temperature_S > 0, drawn_S, greedy_S).astype(jnp.int32)


def _greedy(logits_SV: jax.Array, rows: RowSampling) -> jax.Array:
    del rows
    return jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)


def sample(logits_SV: jax.Array, rows: RowSampling, top_n: int):
    """(tokens [S], their log-probabilities [S], the top_n likeliest tokens [S, top_n] and
    theirs): log-softmax of the raw float32 logits, whatever the sampling cut. The sort that
    sampling needs is skipped when every row is greedy."""
    logits_SV = logits_SV.astype(jnp.float32)
    # Module-level branches, not lambdas: cond keys its traced branches on the functions,
    # so a new lambda per call would trace, compile and keep a new program on every eager
    # call (test_inference drew 800 times: 16k XLA:CPU kernels, each its own memory map).
    tokens_S = jax.lax.cond(jnp.any(rows.temperature_S > 0), _draw, _greedy, logits_SV, rows)
    logprobs_SV = jax.nn.log_softmax(logits_SV, axis=-1)
    chosen_S = jnp.take_along_axis(logprobs_SV, tokens_S[:, None], axis=-1)[:, 0]
    if top_n:
        top_lp_SN, top_ids_SN = jax.lax.top_k(logprobs_SV, top_n)
    else:
        top_lp_SN = jnp.zeros((logits_SV.shape[0], 0), jnp.float32)
        top_ids_SN = jnp.zeros((logits_SV.shape[0], 0), jnp.int32)
    return tokens_S, chosen_S, top_ids_SN.astype(jnp.int32), top_lp_SN
