"""What every cached decode shares (GQA's and MLA's): the new tokens' positions, the masks
of what they see, and their write into the cache, for one start shared by the batch (a
scalar, as one prompt decodes) or one start per row (a [B] vector: the engine's slots, each
at its own position).

A layer reads the cache as it was and attends to two blocks of keys: the cache's positions
before each row's start, and the T new tokens' own keys. It returns those new entries, and
the model writes every layer's at once after its last layer (write_layers). Written inside
the layer scan, the cache would be the scan's output, a new [layers, ...] array: every step
would copy the whole cache (a 2-core CPU, SmolLM-135M's shape, 32 slots of 192 positions:
the step took 337 ms, 193 written after); written after, a step writes only the T new
positions of each row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models.attention.scaffold import causal_mask


def positions(start, length: int) -> jax.Array:
    """The positions of `length` new tokens from `start`: [T] for a scalar start, [B, T]
    for a [B] vector (rope and the position table take either)."""
    start = jnp.asarray(start)
    if start.ndim == 0:
        return start + jnp.arange(length)
    return start[:, None] + jnp.arange(length)[None, :]


# The caches' logical axes (the rules table maps them; plan/decode.py reads them). Length
# is the second to last axis of every cache: GQA's keys and values [B, G, M, K] per layer
# (heads before positions, as a step's two matmuls take them: [B, M, G, K] made XLA:CPU
# transpose the whole cache in every layer of every step, 57 ms of that 193 ms step), MLA's
# latents [B, M, R].
KV_AXES = ("layers", "batch", "kv_heads", "length", "kv")
LATENT_AXES = ("layers", "batch", "length", None)


def write(cache_Bx: jax.Array, new_Bx: jax.Array, start) -> jax.Array:
    """The cache with the new tokens' entries at [start, start + T) of each row, on the
    length axis (the second to last)."""
    new_Bx = new_Bx.astype(cache_Bx.dtype)
    start = jnp.asarray(start)
    if start.ndim == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache_Bx, new_Bx, start, cache_Bx.ndim - 2)
    # One slice per row: a scatter of T entries, not a rewrite of the whole cache.
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, c.ndim - 2))(
        cache_Bx, new_Bx, start)


def first(cache: tuple, keys: int | None) -> tuple:
    """A layer's cache arrays cut to their first `keys` positions (None: all of them): what
    a step reads when every row's position is below `keys` (the engine's key buckets)."""
    if keys is None:
        return cache
    return tuple(jax.lax.slice_in_dim(c, 0, keys, axis=c.ndim - 2) for c in cache)


def write_layers(cache_LBx: jax.Array, new_LBx: jax.Array, start) -> jax.Array:
    """Every layer's cache ([layers, B, ...]) with its new entries written (the module
    docstring): in place on a donated cache."""
    return jax.vmap(write, in_axes=(0, 0, None))(cache_LBx, new_LBx, start)


def joint_softmax(scores: list) -> list:
    """One float32 softmax over blocks of scores side by side on their last axis, split
    back into each block's probabilities (one block: its own softmax, no concatenate)."""
    if len(scores) == 1:
        return [jax.nn.softmax(scores[0], axis=-1)]
    cuts = np.cumsum([s.shape[-1] for s in scores[:-1]])
    return jnp.split(jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1), cuts, axis=-1)


def _per_row(mask, positions_xT: jax.Array, *args):
    """mask(positions_T, *args) for shared positions, vmapped over rows for [B, T]."""
    if positions_xT.ndim == 1:
        return mask(positions_xT, *args)
    return jax.vmap(lambda p_T: mask(p_T, *args))(positions_xT)


def _before_start(p_T, keys: int, window):
    """The cache's keys before the new tokens' first position, as far as the window."""
    k_M = jnp.arange(keys)
    return causal_mask(p_T, k_M, window) & (k_M < p_T[0])[None, :]


def visible_cached(positions_xT: jax.Array, keys: int, window: int | None) -> jax.Array:
    """Bool [T, M] (shared positions) or [B, T, M] (per row): the cache's keys each new
    token sees. Only those before the row's start: the cache's later entries are another
    request's or unwritten, and the new tokens' own keys are the other block."""
    return _per_row(_before_start, positions_xT, keys, window)


def visible_new(positions_xT: jax.Array, window: int | None) -> jax.Array:
    """Bool [T, T] or [B, T, T]: the new tokens' own keys each of them sees (causal)."""
    return _per_row(lambda p_T: causal_mask(p_T, p_T, window), positions_xT)
