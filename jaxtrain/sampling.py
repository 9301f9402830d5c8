"""Fixed-length generation for the tests and scripts that want [B, N] tokens from a batch
of equal-length prompts, on the generation engine (jaxtrain/engine/: one decode path for
everything); and `pick`, one sampling draw per row, as the engine's decode step draws.

The engine is what generate, serve, task evaluation and RL use: ragged prompts, stops at
EOS ids and stop strings, log-probabilities, continuous batching.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.engine import Engine, Model, Request, SamplingParams
from jaxtrain.engine.sampler import RowSampling, sample
from jaxtrain.errors import ConfigError


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


def seed_of(key: jax.Array) -> int:
    """A request seed (uint32) from a jax PRNG key: its key data, folded."""
    data = np.asarray(jax.random.key_data(key)).astype(np.uint64).ravel()
    return int((data[0] * 0x9E3779B1 + data[-1]) % (1 << 32))


def pick(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row: argmax, or a draw from the tempered, truncated softmax
    (the engine's sampler, engine/sampler.py)."""
    b = logits_BV.shape[0]
    full = lambda v, dt: jnp.full((b,), v, dt)  # noqa: E731
    rows = RowSampling(full(sampling.temperature, jnp.float32), full(sampling.top_k, jnp.int32),
                       full(sampling.top_p, jnp.float32), full(0.0, jnp.float32),
                       full(seed_of(key), jnp.uint32), jnp.arange(b, dtype=jnp.int32),
                       full(0, jnp.int32))
    return sample(logits_BV, rows, 0)[0]


def make_generate(graphdef: nnx.GraphDef, sampling: Sampling, rules) -> Callable:
    """(params, prompt_BP, key) -> [B, max_new_tokens] tokens continuing each row, every
    row its full length (no EOS), on the engine with B slots. Call it under the mesh the
    parameters lie on (jax.set_mesh); engines are kept by batch size, so a second call of
    the same shape compiles nothing."""
    engines: dict[int, Engine] = {}

    def generate(params, prompt_BP, key) -> np.ndarray:
        prompt_BP = np.asarray(prompt_BP)
        batch = prompt_BP.shape[0]
        spec = nnx.merge(graphdef, params).spec
        model = Model(graphdef, params, None, rules, spec.vocab_size, spec.seq_len)
        if batch not in engines:
            engines[batch] = Engine(model, slots=batch)
        engine = engines[batch]
        engine.model = model
        params_ = SamplingParams(max_new_tokens=sampling.max_new_tokens,
                                 temperature=sampling.temperature, top_k=sampling.top_k,
                                 top_p=sampling.top_p, seed=seed_of(key), ignore_eos=True)
        # one request of B samples would share one prompt; B requests keep each row's own
        done = engine.generate([Request(tuple(int(t) for t in row), params_)
                                for row in prompt_BP])
        return np.asarray([c[0].ids for c in done], np.int32)

    return generate
