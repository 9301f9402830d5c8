"""The engine's compiled functions over a KV cache of a fixed number of slots, whose shape
never changes: prefill (a prompt, padded to its length's bucket), insert (a prefilled
cache into a slot) and one decode step over every slot, each row at its own position,
reading the cache as far as the busiest row needs (a power-of-two bucket of positions).

The model's own decode (models/transformer.py `decode`, per-row starts) runs every
attention kind as training does: GQA, sliding windows, sinks, soft-caps, MLA's latent
cache, MoE. The parameters are used where they lie (no copy, no gather): on a
tensor-parallel mesh the cache is sharded like the heads, and each step runs sharded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.engine.sampler import RowSampling, sample

MIN_BUCKET = 8
# The fewest cache positions a decode step reads (key_bucket): small models' tests compile
# one step, and a long cache compiles a handful (128, 256, ... max_len).
MIN_KEYS = 128


@dataclasses.dataclass(frozen=True)
class Model:
    """What the engine decodes with: a model's graph, its parameters (where they lie), the
    mesh they lie on (None: the caller's, set with jax.set_mesh) and its sharding rules."""

    graphdef: nnx.GraphDef
    params: dict
    mesh: jax.sharding.Mesh | None
    rules: tuple
    vocab_size: int
    seq_len: int

    @classmethod
    def of(cls, loaded) -> Model:
        """A LoadedModel's (jaxtrain/inference.py), its parameters as they are."""
        setup = loaded.setup
        return cls(setup.graphdef, loaded.params, setup.mesh, setup.spec.rules,
                   setup.spec.vocab_size, setup.spec.seq_len)


def bucket(length: int, max_len: int) -> int:
    """The padded length a prefill of `length` tokens compiles for: the next power of two
    (at least MIN_BUCKET), at most max_len, so that few lengths ever compile."""
    return min(max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length()), max_len)


def key_bucket(need: int, max_len: int) -> int:
    """The cache positions a decode step reads when its rows reach position need − 1: the
    next power of two (at least MIN_KEYS), at most max_len. A step's attention then follows
    the rows' lengths, not the cache's (max_len defaults to model.seq_len), in a few
    compiled variants."""
    return min(max(MIN_KEYS, 1 << max(need - 1, 0).bit_length()), max_len)


class Steps:
    """jit-compiled prefill, insert and decode step of one model and cache shape."""

    def __init__(self, model: Model, slots: int, max_len: int, top_n: int):
        self.model, self.slots, self.max_len, self.top_n = model, slots, max_len, top_n
        graphdef = model.graphdef
        self.init_cache = jax.jit(functools.partial(_init_cache, graphdef, slots, max_len))
        self.prefill = jax.jit(functools.partial(_prefill, graphdef))
        self.insert = jax.jit(_insert, donate_argnums=0)
        self.step = jax.jit(functools.partial(_step, graphdef, top_n), donate_argnums=1,
                            static_argnames="keys")


def _init_cache(graphdef, slots: int, max_len: int, params):
    return nnx.merge(graphdef, params).init_cache(slots, max_len)


def _prefill(graphdef, params, tokens_1P, valid):
    """The cache of a prompt's first P positions (a fresh one, P long), of which the first
    `valid` are the prompt's (the rest its bucket's padding, which a linear-attention
    layer's state must not take). The logits are not returned, so XLA drops the output
    head. The fresh cache holds nothing before the prompt: its attention reads none of it
    (keys=0), only the prompt's own keys."""
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(1, tokens_1P.shape[1])
    return model.decode(tokens_1P, cache, jnp.int32(0), valid, keys=0)[1]


def _insert(cache, piece, slot):
    """cache with `piece` ([layers, 1, P, ...] each) at slot `slot`, positions [0, P)."""
    return jax.tree.map(
        lambda c, p: jax.lax.dynamic_update_slice(
            c, p.astype(c.dtype), (0, slot) + (0,) * (c.ndim - 2)), cache, piece)


def _step(graphdef, top_n: int, params, cache, tokens_S, positions_S, rows: RowSampling,
          keys: int | None = None):
    """One token of every slot at its own position, reading the cache's first `keys`
    positions (key_bucket; None: all): (cache, next tokens [S], their log-probabilities
    [S], the top_n alternatives' ids and log-probabilities [S, top_n])."""
    model = nnx.merge(graphdef, params)
    logits_S1V, cache = model.decode(tokens_S[:, None], cache, positions_S, keys=keys)
    return (cache, *sample(logits_S1V[:, 0], rows, top_n))
