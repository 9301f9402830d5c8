"""jax's Pallas splash-attention kernel for TPUs (Mosaic), with the contract of
models/attention/kernels.py: q_BLHK arrives scaled by head_dim**-0.5 (the kernel does
not scale again), attention is causal, kv heads are grouped (G divides H), and the output has
q's dtype. Optionally a sliding window: query i sees keys i - window + 1 .. i (`window` keys,
itself included).

The kernel is per example and head-major ([H, L, K]), so the batch is a vmap and the layout a
transpose. It is a custom call that XLA's partitioner cannot split, so under a mesh with
sharded batch or heads it runs in a shard_map over them (as models/attention/layer.py constrains
them: the `batch` and `heads`/`kv_heads` logical axes), each device computing its own
examples and heads with no communication.

Document masks: segment ids [B, L] (models/attention/kernels.py) become the kernel's
`SegmentIds(q, kv)` per example (both the row's ids: self-attention), and-ed with the causal
mask inside the kernel.

Off TPU the kernel runs in Pallas's interpreter (slow; for tests at tiny shapes).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.mesh import DEFAULT_RULES, logical_to_spec

LANES = 128  # the kernel's kv block (and its compute slice) must be a multiple of this


def _block(length: int, largest: int) -> int:
    """The largest power-of-two block <= `largest` dividing `length`, at least LANES."""
    if length % LANES:
        raise ValueError(f"splash attention needs sequence lengths that are multiples of "
                         f"{LANES}; got {length}")
    if largest < LANES or largest & (largest - 1):
        raise ValueError(f"block must be a power of two >= {LANES}; got {largest}")
    block = largest
    while length % block:
        block //= 2
    return block


def _kernel(heads: int, q_len: int, kv_len: int, mqa: bool, window: int | None,
            block: int, interpret):
    """The splash kernel for one example: static mask, block sizes and head grouping. Built
    per trace (it holds its mask tables as arrays); the mask processing itself is cached by
    jax."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (q_len, kv_len)
    if window is None:
        mask = splash.CausalMask(shape)
    else:
        # LocalMask keeps q - left <= k <= q + right: (window - 1, 0) is causal with `window`
        # keys. Blocks wholly outside the band are skipped by the kernel.
        mask = splash.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    bq, bkv = _block(q_len, block), _block(kv_len, block)
    blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                               block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                               block_q_dq=bq, block_kv_dq=bkv)
    make = splash.make_splash_mqa_single_device if mqa else \
        splash.make_splash_mha_single_device
    return make(splash.MultiHeadMask([mask] * heads), block_sizes=blocks,
                interpret=interpret)


def _local(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array, segments_BL,
           window: int | None, block: int, interpret) -> jax.Array:
    """Attention of unsharded (or per-device) arrays; interpret=None: compiled when lowered
    for TPU, interpreted on other platforms."""
    if interpret is None:
        # Chosen at lowering time: an ahead-of-time compile for a TPU topology traces in a
        # process whose default backend is CPU.
        compiled = functools.partial(_local, window=window, block=block, interpret=False)
        interpreted = functools.partial(_local, window=window, block=block, interpret=True)
        return jax.lax.platform_dependent(q_BLHK, k_BMGK, v_BMGK, segments_BL, tpu=compiled,
                                          default=interpreted)
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    heads, groups = q_BLHK.shape[2], k_BMGK.shape[2]
    mqa = groups == 1
    kernel = _kernel(heads, q_BLHK.shape[1], k_BMGK.shape[1], mqa, window, block, interpret)
    q_BHLK = q_BLHK.transpose(0, 2, 1, 3)
    if mqa:  # one kv head shared by all query heads: the kernel takes k, v as [M, K]
        k_BxK, v_BxK = k_BMGK[:, :, 0], v_BMGK[:, :, 0]
    else:
        k_BxK, v_BxK = k_BMGK.transpose(0, 2, 1, 3), v_BMGK.transpose(0, 2, 1, 3)
    if segments_BL is None:
        out_BHLK = jax.vmap(kernel)(q_BHLK, k_BxK, v_BxK)
    else:
        out_BHLK = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=splash.SegmentIds(
            ids, ids)))(q_BHLK, k_BxK, v_BxK, segments_BL)
    return out_BHLK.transpose(0, 2, 1, 3).astype(q_BLHK.dtype)


def splash_attention(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array,
                     window: int | None = None, segments_BL=None, *, rules=None,
                     block: int = 512, interpret=None) -> jax.Array:
    """Causal (optionally sliding-window) grouped-query attention by the splash kernel;
    segments_BL: document masks (None: none).

    rules: the logical-axis rules the activations were constrained with (default
    config.DEFAULT_RULES); they say how batch and heads are split over the current mesh.
    block: the largest query/kv tile (the largest power of two up to it dividing the length).
    interpret: None compiles the kernel for TPU and interprets it elsewhere (by the platform
    the step is lowered for); True/False or a pltpu.InterpretParams force one.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None; got {window}")
    heads, groups = q_BLHK.shape[2], k_BMGK.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} query heads cannot be grouped over {groups} kv heads")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.axis_sizes) == 1:
        return _local(q_BLHK, k_BMGK, v_BMGK, segments_BL, window, block, interpret)
    rules = DEFAULT_RULES if rules is None else rules
    q_spec = logical_to_spec(("batch", "length", "heads", "kv"), rules)
    kv_spec = logical_to_spec(("batch", "length", "kv_heads", "kv"), rules)
    q_spec, kv_spec = _fit(q_spec, q_BLHK.shape, mesh), _fit(kv_spec, k_BMGK.shape, mesh)
    if kv_spec[2] != q_spec[2]:
        # The kv heads cannot be split like the query heads (fewer kv heads than devices on
        # that axis): give each query head its own copy so that the grouping stays local.
        k_BMGK = jnp.repeat(k_BMGK, heads // groups, axis=2)
        v_BMGK = jnp.repeat(v_BMGK, heads // groups, axis=2)
        kv_spec = q_spec
    # The ids travel with their examples: batch split like the queries', length whole.
    ids_spec = None if segments_BL is None else P(q_spec[0], None)
    run = jax.shard_map(functools.partial(_local, window=window, block=block,
                                          interpret=interpret),
                        mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ids_spec),
                        out_specs=q_spec, check_vma=False)
    return run(q_BLHK, k_BMGK, v_BMGK, segments_BL)


def _fit(spec: P, shape, mesh) -> P:
    """spec for the kernel: length and head_dim whole on each device, and any mesh axes that
    do not divide their dimension dropped."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    out = []
    for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = []
        for name in names:
            if dim in (0, 2) and size % (math.prod(sizes[n] for n in kept) * sizes[name]) == 0:
                kept.append(name)
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return P(*out)
