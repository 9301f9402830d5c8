"""What every cached decode shares (GQA's and MLA's): the new tokens' positions, their
write into the cache and the causal mask over it, for one start shared by the batch (a
scalar, as one prompt decodes) or one start per row (a [B] vector: the engine's slots, each
at its own position)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.attention.scaffold import causal_mask


def positions(start, length: int) -> jax.Array:
    """The positions of `length` new tokens from `start`: [T] for a scalar start, [B, T]
    for a [B] vector (rope and the position table take either)."""
    start = jnp.asarray(start)
    if start.ndim == 0:
        return start + jnp.arange(length)
    return start[:, None] + jnp.arange(length)[None, :]


def write(cache_BMx: jax.Array, new_BTx: jax.Array, start) -> jax.Array:
    """The cache with the new tokens' entries at [start, start + T) of each row."""
    new_BTx = new_BTx.astype(cache_BMx.dtype)
    start = jnp.asarray(start)
    if start.ndim == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache_BMx, new_BTx, start, 1)
    # One slice per row: a scatter of T entries, not a rewrite of the whole cache.
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, 0))(
        cache_BMx, new_BTx, start)


def visible(positions_xT: jax.Array, keys: int, window: int | None) -> jax.Array:
    """Bool [T, M] (shared positions) or [B, T, M] (per row): the keys each new token
    sees; the cache's entries past a row's position are another request's or unwritten,
    and the causal mask hides them."""
    if positions_xT.ndim == 1:
        return causal_mask(positions_xT, jnp.arange(keys), window)
    return jax.vmap(lambda p_T: causal_mask(p_T, jnp.arange(keys), window))(positions_xT)
