"""Autoregressive decoding with a KV cache: one jitted prefill and a scan of one-token steps.

The cache holds every layer's keys and values for prompt + new tokens ([layers, B, M, G, K],
sharded like the attention heads), so each new token costs one forward over one position.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import ConfigError
from jaxtrain.mesh import constrain


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy (argmax), deterministic
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0  # nucleus: the smallest set of tokens holding this probability

    def check(self) -> None:
        for name, ok, valid in (("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
                                ("temperature", self.temperature >= 0, ">= 0"),
                                ("top_k", self.top_k >= 0, ">= 0 (0: off)"),
                                ("top_p", 0 < self.top_p <= 1, "in (0, 1]")):
            if not ok:
                raise ConfigError(f"--{name}={getattr(self, name)} is invalid: must be {valid}")


def pick(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row: argmax, or a draw from the tempered, truncated softmax."""
    logits_BV = logits_BV.astype(jnp.float32)
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / sampling.temperature
    if sampling.top_k:
        kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if sampling.top_p < 1:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # Keep a token while the mass before it is under top_p (the first is always kept).
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        cutoff_B1 = jnp.min(jnp.where(before_BV < sampling.top_p, sorted_BV, jnp.inf),
                            axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def make_generate(graphdef: nnx.GraphDef, sampling: Sampling, rules) -> Callable:
    """jit((params, prompt_BP, key) -> [B, max_new_tokens] tokens continuing each row)."""
    return jax.jit(functools.partial(_generate, graphdef, sampling, rules))


def _generate(graphdef, sampling: Sampling, rules, params, prompt_BP, key):
    model = nnx.merge(graphdef, params)
    batch, prompt_len = prompt_BP.shape
    cache = model.init_cache(batch, prompt_len + sampling.max_new_tokens)
    logits_BPV, cache = model.decode(prompt_BP, cache, jnp.int32(0))
    first_B = pick(logits_BPV[:, -1], jax.random.fold_in(key, 0), sampling)

    def step(carry, i):
        token_B, cache = carry
        logits_B1V, cache = model.decode(token_B[:, None], cache, prompt_len + i)
        next_B = pick(logits_B1V[:, 0], jax.random.fold_in(key, i + 1), sampling)
        return (next_B, cache), next_B

    steps = jnp.arange(sampling.max_new_tokens - 1, dtype=jnp.int32)
    _, rest_NB = jax.lax.scan(step, (first_B, cache), steps)
    tokens_BN = jnp.concatenate([first_B[:, None], rest_NB.T], axis=1)
    return constrain(tokens_BN, ("batch", None), rules)
