"""Fingerprints of a checkpoint's contents: a file's xxh3, a tree's signature (shapes and
dtypes), every floating leaf's sum of squares and every numeric leaf's wrapping sum of bits,
computed where the arrays lie (any mesh gives the same figures). Checkpoints records them at
a save; train/restore_check.py compares a restored state against them."""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_CHUNK = 8 << 20


def file_checksum(path: pathlib.Path) -> str:
    """xxh3-64 of a file's bytes, read in 8 MiB pieces (≈4 GB/s on one core)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def tree_signature(tree) -> dict[tuple, tuple]:
    """{path: (shape, dtype)} of a pytree of arrays or array metadata, path as strings."""
    return {tuple(map(_key_name, path)): (tuple(leaf.shape), str(leaf.dtype))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@functools.lru_cache(maxsize=8)
def _sums_of_squares(mesh):
    """jit(leaves) -> [sum of squares per leaf], in float32, replicated (every process of a
    job can read it)."""
    return jax.jit(lambda leaves: jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32)))
                                             for x in leaves]),
                   out_shardings=None if mesh is None else NamedSharding(mesh, P()))


def _as_words(x):
    """A leaf's bits as unsigned words (one per element; two for 64-bit types)."""
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@functools.lru_cache(maxsize=8)
def _bit_sums(mesh):
    """jit(leaves) -> [sum of each leaf's bits as uint32 words, wrapping], replicated:
    integer addition modulo 2**32 is exact in any order, so the figure is the same on any
    mesh and changes with almost any change of any bit."""
    return jax.jit(lambda leaves: jnp.stack([jnp.sum(_as_words(x), dtype=jnp.uint32)
                                             for x in leaves]),
                   out_shardings=None if mesh is None else NamedSharding(mesh, P()))


def _per_leaf(tree, kind, reducer) -> dict[str, np.ndarray]:
    """{'params/blocks/attn/w_q': reducer's figure for that leaf, ...} for the leaves of
    dtype `kind`, computed where they lie in one jitted pass (one small array comes back;
    leaves offloaded to host memory are brought to the devices for it)."""
    flat = [(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jnp.issubdtype(leaf.dtype, kind)]
    if not flat:
        return {}
    leaves = [leaf if leaf.sharding.memory_kind in (None, "device")
              else jax.device_put(leaf, leaf.sharding.with_memory_kind("device"))
              for _, leaf in flat]
    sharding = leaves[0].sharding
    values = np.asarray(reducer(
        sharding.mesh if isinstance(sharding, NamedSharding) else None)(leaves))
    return {"/".join(map(_key_name, path)): value for (path, _), value in zip(flat, values)}


def tree_bits(tree) -> dict[str, int]:
    """{'params/blocks/attn/w_q': the wrapping sum of its bits, ...} of every numeric leaf
    (floating and integer): an exact fingerprint of the contents, where the sums of squares
    (tree_sums) miss damage that leaves a leaf's magnitude (tiny values of Adam's second
    moments turned tinier, an integer counter)."""
    return {name: int(v) for name, v in _per_leaf(tree, jnp.number, _bit_sums).items()}


def tree_sums(tree) -> dict[str, float]:
    """{'params/blocks/attn/w_q': sum of its squares, ...} of every floating leaf of a pytree
    of arrays: a fingerprint of its contents, the same on any mesh up to float
    reassociation."""
    return {name: float(v)
            for name, v in _per_leaf(tree, jnp.floating, _sums_of_squares).items()}
