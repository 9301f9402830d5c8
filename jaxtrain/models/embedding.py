"""The token embedding lookup, with a gradient formed in the table's own sharding.

Forward: the table is gathered over its ZeRO axes (fsdp, context: it stays split by vocab
over `tensor`) and each token's row taken, as for any weight. Backward by autodiff is a
scatter-add of every token's gradient into a zero [V, D] float32 table, which XLA's
partitioner forms whole on every device and then all-reduces (four such tables per device
in gpt13b's compiled step: 3.9 GB). Here the scatter runs inside a shard_map, straight into
the table's shard: the devices of the ZeRO group (fsdp × context, which the embed dimension
is split over) all-gather their token ids and exchange the token gradients by all-to-all so
that each holds every token's gradient for its 1/z of D; each adds the rows that fall in
its vocab range (split over tensor) into a [V/t, D/z] float32 buffer, and a psum over the
remaining batch axes (data, expert) completes the sum.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.mesh import constrain, logical_to_spec

TOKENS = ("batch", "sequence")
TABLE = ("vocab", "embed")


def embed(table_VD: jax.Array, tokens_BL: jax.Array, dtype, rules) -> jax.Array:
    """table_VD[tokens] in `dtype`: [B, L, D]."""
    if jax.sharding.get_abstract_mesh().empty or not isinstance(table_VD, jax.Array):
        # Eager unsharded use, or an int8 table (inference only): no gradient to shard.
        return _lookup(table_VD, tokens_BL, dtype, rules)
    meta = (table_VD.shape, jnp.dtype(table_VD.dtype), jnp.dtype(dtype), tuple(rules))
    return _embed(table_VD, tokens_BL, meta)


def _lookup(table_VD, tokens_BL, dtype, rules):
    table_VD = constrain(table_VD.astype(dtype), ("vocab", None), rules)
    return jnp.take(table_VD, tokens_BL, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _embed(table_VD, tokens_BL, meta):
    return _lookup(table_VD, tokens_BL, meta[2], meta[3])


def _embed_fwd(table_VD, tokens_BL, meta):
    return _lookup(table_VD, tokens_BL, meta[2], meta[3]), tokens_BL


def _names(axes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _embed_bwd(meta, tokens_BL, dx_BLD):
    (vocab, _), table_dtype, dtype, rules = meta
    tokens_spec = logical_to_spec(TOKENS, rules)
    vocab_axes, embed_axes = (_names(a) for a in logical_to_spec(TABLE, rules))
    token_axes = tuple(a for axes in tokens_spec for a in _names(axes))
    if not set(embed_axes) <= set(token_axes) or set(vocab_axes) & set(embed_axes):
        # A layout this scatter does not cover: autodiff's (correct, unsharded) gradient.
        zeros = jnp.zeros(meta[0], table_dtype)
        return jax.vjp(lambda t: _lookup(t, tokens_BL, dtype, rules), zeros)[1](dx_BLD)[0], None
    body = functools.partial(_local_grad, vocab=vocab, vocab_axes=vocab_axes,
                             embed_axes=embed_axes, token_axes=token_axes)
    grad = jax.shard_map(body, in_specs=(tokens_spec, P(*tokens_spec, None)),
                         out_specs=P(vocab_axes or None, embed_axes or None),
                         check_vma=False)(tokens_BL, dx_BLD)
    return grad.astype(table_dtype), None


_embed.defvjp(_embed_fwd, _embed_bwd)


def _local_grad(tokens_BL, dx_BLD, *, vocab: int, vocab_axes, embed_axes, token_axes):
    """This device's [V/t, D/z] shard of the table's gradient."""
    # Tokens split over a vocab axis (sequence parallelism splits them over tensor): every
    # device of that axis needs all of them, for its own vocab range.
    for axis in (a for a in vocab_axes if a in token_axes):
        tokens_BL = jax.lax.all_gather(tokens_BL, axis, axis=1, tiled=True)
        dx_BLD = jax.lax.all_gather(dx_BLD, axis, axis=1, tiled=True)
    ids_N = tokens_BL.reshape(-1)
    dx_ND = dx_BLD.reshape(ids_N.shape[0], -1)
    if embed_axes:
        # Every token of the ZeRO group with this device's slice of D: the ids all-gathered,
        # the gradients exchanged (all-to-all: each device keeps 1/z of its rows' D, and
        # gets that slice of everyone's), so the scatter below is already [V/t, D/z].
        ids_N = jax.lax.all_gather(ids_N, embed_axes, axis=0, tiled=True)
        dx_ND = jax.lax.all_to_all(dx_ND, embed_axes, split_axis=1, concat_axis=0, tiled=True)
    rows = vocab // math.prod(jax.lax.axis_size(a) for a in vocab_axes)
    first = jax.lax.axis_index(vocab_axes) * rows if vocab_axes else 0
    local = ids_N - first
    local = jnp.where((local >= 0) & (local < rows), local, rows)  # out of range: dropped
    grad = jnp.zeros((rows, dx_ND.shape[1]), jnp.float32).at[local].add(
        dx_ND.astype(jnp.float32), mode="drop")
    summed = tuple(a for a in token_axes if a not in vocab_axes and a not in embed_axes)
    return jax.lax.psum(grad, summed) if summed else grad
