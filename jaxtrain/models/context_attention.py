"""Causal attention with the sequence split over the `context` mesh axis (parallel/context.py).

Inside a shard_map over the mesh each device holds the queries, keys and values of its T =
L/C slots (and of its examples and heads, split as the logical rules say). Its queries must
meet every key block of the row, which arrives in one of two ways (`model.context_attention`):

- **allgather**: the row's K/V (and key segment ids) all-gathered over `context` once, then
  visited block by block. One collective; the device holds the row's K/V.
- **ring**: the device starts with its own block and, C−1 times, passes the block it holds
  to the next device and takes the previous one's (lax.ppermute): after s hops it holds
  device (i − s) mod C's block. A device never holds more than two blocks, and each hop's
  transfer can overlap the previous block's compute.

Either way each block is folded into the output by the online softmax (running max m,
denominator l, unnormalised output o, all float32), so no score matrix wider than a block
exists. Masks come from global positions: each slot's row position is a static function of
the layout and the device index (ContextSpec.slot_positions), so causality, the sliding
window and the zig-zag order need nothing from the batch; document masks compare the
queries' segment ids with those that travel with the keys.

Work: a device's slots are one (plain) or two (zig-zag) contiguous runs, and every pair of
(query run, key run) that the causal window hides entirely is skipped by lax.cond, so the
zig-zag order gives every device the same number of computed pairs.

Backward: jax autodiff through the loop (not a hand-written ring VJP). ppermute transposes
to the reverse ppermute, so the backward is a ring too (dK/dV travel back); each block
update is rematerialised (jax.checkpoint), so what is kept per hop is the block's K/V and
the float32 accumulators, not its scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.mesh import logical_to_spec
from jaxtrain.parallel.context import ContextSpec

AXIS = "context"
_MASKED = -1e30  # as in chunked_attention: exp(_MASKED - max) is 0, and never overflows


def context_attention(q_BLHK, k_BLGK, v_BLGK, window: int | None, segments_BL,
                      spec: ContextSpec, rules) -> jax.Array:
    """Causal GQA attention (q already scaled), the sequence in `spec`'s layout and sharded
    over `context`; the contract of attention.xla_attention otherwise."""
    q_spec = logical_to_spec(("batch", "length", "heads", "kv"), rules)
    kv_spec = logical_to_spec(("batch", "length", "kv_heads", "kv"), rules)
    if q_spec[1] != AXIS or kv_spec[1] != AXIS:
        raise ValueError(f"context attention needs the `length` rule on `{AXIS}`; the rules "
                         f"give {q_spec}")
    ids_spec = None if segments_BL is None else P(q_spec[0], AXIS)
    body = functools.partial(_local, spec=spec, window=window,
                             positions_CT=spec.slot_positions(q_BLHK.shape[1]))
    run = jax.shard_map(body, in_specs=(q_spec, kv_spec, kv_spec, ids_spec),
                        out_specs=q_spec, check_vma=False)
    return run(q_BLHK, k_BLGK, v_BLGK, segments_BL)


def _local(q_BTHK, k_BTGK, v_BTGK, segments_BT, *, spec: ContextSpec, window, positions_CT):
    """One device: its queries against every key block of the row."""
    groups = k_BTGK.shape[2]
    b, t, heads, head_dim = q_BTHK.shape
    q_BTGRK = q_BTHK.reshape(b, t, groups, heads // groups, head_dim)
    table_CT = jnp.asarray(positions_CT)
    me = jax.lax.axis_index(AXIS)
    queries = _Runs(q_BTGRK, segments_BT, table_CT[me], spec.chunks_per_device)
    block = (k_BTGK, v_BTGK, segments_BT)
    accs = queries.fold(queries.empty(), block, table_CT[me], window)
    visit = _allgather if spec.variant == "allgather" else _ring
    accs = visit(queries, accs, block, table_CT, me, spec.size, window)
    out_BGRTK = jnp.concatenate([o / denom[..., None] for o, _, denom in accs], axis=3)
    return out_BGRTK.transpose(0, 3, 1, 2, 4).reshape(q_BTHK.shape).astype(q_BTHK.dtype)


def _ring(queries, accs, block, table_CT, me, size: int, window):
    """Blocks 1..C−1 hops away, each passed on by one ppermute."""
    shift = [(j, (j + 1) % size) for j in range(size)]

    def hop(carry, s):
        accs, block = carry
        block = jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, shift), block)
        return (queries.fold(accs, block, table_CT[(me - s) % size], window), block), None

    return jax.lax.scan(hop, (accs, block), jnp.arange(1, size))[0][0]


def _allgather(queries, accs, block, table_CT, me, size: int, window):
    """The other devices' blocks, from one all-gather of the row's K/V."""
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS, axis=0), block)

    def visit(accs, s):
        j = (me - s) % size  # the ring's order, so both variants sum alike
        return queries.fold(accs, jax.tree.map(lambda x: x[j], gathered), table_CT[j],
                            window), None

    return jax.lax.scan(visit, accs, jnp.arange(1, size))[0]


QUERY_BLOCK = 512  # query rows per score tile: [rows, key run] float32 per (batch, head)


def _pieces(length: int) -> int:
    """Equal pieces of at most QUERY_BLOCK rows that a run of `length` queries is cut into."""
    return next(n for n in range(1, length + 1)
                if length % n == 0 and length // n <= QUERY_BLOCK)


class _Runs:
    """A device's queries as their contiguous runs of positions (1, or 2 when zig-zag), each
    cut into tiles of ≤ QUERY_BLOCK rows with their own online-softmax accumulator (o, m,
    l): the scores of a tile against a key run are the largest array the kernel makes."""

    def __init__(self, q_BTGRK, segments_BT, positions_T, runs: int):
        self.runs = runs  # key runs per block: the same contiguous runs
        tiles = runs * _pieces(q_BTGRK.shape[1] // runs)
        self.q = jnp.split(q_BTGRK, tiles, axis=1)
        self.segments = _split_or_none(segments_BT, tiles)
        self.positions = jnp.split(positions_T, tiles)

    def empty(self):
        b, t, g, r, k = self.q[0].shape
        return [(jnp.zeros((b, g, r, t, k), jnp.float32),
                 jnp.full((b, g, r, t), _MASKED, jnp.float32),
                 jnp.zeros((b, g, r, t), jnp.float32)) for _ in self.q]

    def fold(self, accs, block, positions_T, window):
        """accs with one key block (its k, v, segment ids and row positions) folded in,
        tile by key run; pairs the causal window hides entirely are skipped."""
        k_BTGK, v_BTGK, segments_BT = block
        keys = list(zip(jnp.split(k_BTGK, self.runs, axis=1),
                        jnp.split(v_BTGK, self.runs, axis=1),
                        _split_or_none(segments_BT, self.runs),
                        jnp.split(positions_T, self.runs)))
        # Rematerialised in the backward pass, so no tile's scores are ever kept.
        update = jax.checkpoint(functools.partial(_update, window=window))
        out = []
        for acc, q, q_ids, q_pos in zip(accs, self.q, self.segments, self.positions):
            for k, v, k_ids, k_pos in keys:
                acc = jax.lax.cond(_any_visible(q_pos, k_pos, window), update,
                                   lambda acc, *_: acc, acc, q, k, v, q_ids, k_ids, q_pos,
                                   k_pos)
            out.append(acc)
        return out


def _split_or_none(x, parts: int):
    return [None] * parts if x is None else jnp.split(x, parts, axis=1)


def computed_scores(spec: ContextSpec, length: int, window: int | None = None) -> np.ndarray:
    """[C]: the query×key scores each device's kernel computes per row and head (the
    (query tile, key run) pairs `_any_visible` keeps, masked parts included): the work the
    step waits on."""
    positions_CT = spec.slot_positions(length)
    runs = spec.chunks_per_device
    tiles = runs * _pieces(positions_CT.shape[1] // runs)
    work = np.zeros(spec.size, np.int64)
    for i in range(spec.size):
        for j in range(spec.size):
            for q in np.split(positions_CT[i], tiles):
                for k in np.split(positions_CT[j], runs):
                    if _any_visible(q, k, window):
                        work[i] += len(q) * len(k)
    return work


def _any_visible(q_pos, k_pos, window):
    """Whether any query of a run sees any key of a run (both runs contiguous, ascending)."""
    seen = k_pos[0] <= q_pos[-1]
    if window is not None:
        seen &= k_pos[-1] > q_pos[0] - window
    return seen


def _update(acc, q_BTGRK, k_BMGK, v_BMGK, q_ids_BT, k_ids_BM, q_pos_T, k_pos_M, *, window):
    """One online-softmax step: the block's scores, masked, folded into (o, m, l)."""
    o_BGRTK, m_BGRT, l_BGRT = acc
    s_BGRTM = jnp.einsum("btgrk,bmgk->bgrtm", q_BTGRK, k_BMGK,
                         preferred_element_type=jnp.float32)
    visible_TM = k_pos_M[None, :] <= q_pos_T[:, None]
    if window is not None:
        visible_TM &= k_pos_M[None, :] > q_pos_T[:, None] - window
    visible = visible_TM[None, None, None]
    if q_ids_BT is not None:
        visible = visible & (q_ids_BT[:, :, None] == k_ids_BM[:, None, :])[:, None, None]
    s_BGRTM = jnp.where(visible, s_BGRTM, _MASKED)
    # The output does not depend on the running max, only its float range does.
    m_new = jax.lax.stop_gradient(jnp.maximum(m_BGRT, s_BGRTM.max(-1)))
    p_BGRTM = jnp.where(visible, jnp.exp(s_BGRTM - m_new[..., None]), 0.0)
    scale = jnp.exp(m_BGRT - m_new)
    pv_BGRTK = jnp.einsum("bgrtm,bmgk->bgrtk", p_BGRTM.astype(v_BMGK.dtype), v_BMGK,
                          preferred_element_type=jnp.float32)
    return (o_BGRTK * scale[..., None] + pv_BGRTK, m_new, l_BGRT * scale + p_BGRTM.sum(-1))
