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

Each block is visited in tiles (models/flash.py): a loop over query tiles of ≤ QUERY_TILE
positions and, inside it, over key tiles of ≤ KEY_TILE, each tile folded into the output by
the online softmax (float32 running max, denominator and output), so the largest array the
kernel makes is one [query tile, key tile] score matrix, whatever the length. Masks come from
global positions: each slot's row position is a static function of the layout and the device
index (ContextSpec.slot_positions), so causality, the sliding window and the zig-zag order
need nothing from the batch; document masks compare the queries' segment ids with those that
travel with the keys.

Work: a device's slots are one (plain) or two (zig-zag) contiguous runs, and tiles never
straddle a run, so every tile pair the causal window hides entirely is skipped (lax.cond) and
the zig-zag order gives every device the same number of computed pairs. `count_work` counts
the FLOPs of the tiles each device computes, from inside the compiled step.

Backward: a custom VJP. The residuals are q, k, v, the output and its logsumexp; the
backward visits the blocks again in the same order (the ring passes each block on with its
dK/dV, and one last hop takes them home; allgather sums them back with one reduce-scatter),
recomputing each tile's probabilities. Autodiff through the forward loop would keep the
float32 accumulators of every hop, C times the output's size per layer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import fail
from jaxtrain.mesh import logical_to_spec
from jaxtrain.models.attention import flash
from jaxtrain.parallel.context import ContextSpec

AXIS = "context"
# A run is visited in tiles of positions: query tiles are folded with their R heads into
# R·QUERY_TILE rows, so a score tile is [R·QUERY_TILE, KEY_TILE] float32 per (example, kv
# head). check_mesh refuses a run whose query tiles would fall under MIN_TILE positions.
QUERY_TILE = 128
KEY_TILE = 512
MIN_TILE = 16


def tile_size(length: int, limit: int) -> int:
    """The largest divisor of a run's `length` that is at most `limit`: a tile's size."""
    return next(length // n for n in range(1, length + 1)
                if length % n == 0 and length // n <= limit)


def context_attention(q_BLHK, k_BLGK, v_BLGK, window: int | None, segments_BL,
                      spec: ContextSpec, rules) -> jax.Array:
    """Causal GQA attention (q already scaled), the sequence in `spec`'s layout and sharded
    over `context`; the contract of attention.xla_attention otherwise."""
    q_spec = logical_to_spec(("batch", "length", "heads", "kv"), rules)
    kv_spec = logical_to_spec(("batch", "length", "kv_heads", "kv"), rules)
    if q_spec[1] != AXIS or kv_spec[1] != AXIS:
        raise ValueError(f"context attention needs the `length` rule on `{AXIS}`; the rules "
                         f"give {q_spec}")
    return _attention(q_BLHK, k_BLGK, v_BLGK, segments_BL, spec, window, rules)


class _Specs:
    """How the kernel's arrays are split over the mesh (from the logical rules): q and the
    output [B, L, H, K], k and v [B, L, G, K], segment ids [B, L], logsumexp [B, G, R, L]."""

    def __init__(self, rules, segments: bool):
        self.q = logical_to_spec(("batch", "length", "heads", "kv"), rules)
        self.kv = logical_to_spec(("batch", "length", "kv_heads", "kv"), rules)
        self.ids = P(self.q[0], AXIS) if segments else None
        self.lse = P(self.q[0], self.kv[2], None, AXIS)


# The VJP wraps the shard_maps rather than sitting inside one: differentiating a shard_map
# inside the layers' scan linearises its body, and a custom VJP there was differentiated
# through (every tile's scores kept as scan residuals), not used.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q_BLHK, k_BLGK, v_BLGK, segments_BL, spec, window, rules):
    return _attention_fwd(q_BLHK, k_BLGK, v_BLGK, segments_BL, spec, window, rules)[0]


def _attention_fwd(q_BLHK, k_BLGK, v_BLGK, segments_BL, spec, window, rules):
    specs = _Specs(rules, segments_BL is not None)
    # The checkpoint keeps the forward whole under partial evaluation: the layers' scan
    # hoists loop-invariant parts of its body out of the loop, and the kernel's tile masks
    # (from positions alone) would be hoisted as every (hop, tile) pair's stacked arrays.
    forward = jax.checkpoint(functools.partial(_forward, spec=spec, window=window),
                             policy=jax.checkpoint_policies.nothing_saveable,
                             prevent_cse=False)
    run = jax.shard_map(forward,
                        in_specs=(specs.q, specs.kv, specs.kv, specs.ids),
                        out_specs=(specs.q, specs.lse), check_vma=False)
    out_BLHK, lse_BGRL = run(q_BLHK, k_BLGK, v_BLGK, segments_BL)
    return out_BLHK, (q_BLHK, k_BLGK, v_BLGK, segments_BL, out_BLHK, lse_BGRL)


def _attention_bwd(spec, window, rules, residuals, dout_BLHK):
    specs = _Specs(rules, residuals[3] is not None)
    run = jax.shard_map(functools.partial(_backward, spec=spec, window=window),
                        in_specs=(specs.q, specs.kv, specs.kv, specs.ids, specs.q, specs.lse,
                                  specs.q),
                        out_specs=(specs.q, specs.kv, specs.kv), check_vma=False)
    return (*run(*residuals, dout_BLHK), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


class _Device:
    """One device's view: its queries (grouped [B, G, R, T, K]), their row positions, the
    tile sizes, and the loops over (query tile, key tile) pairs of one visited block."""

    def __init__(self, q_BTHK, groups: int, segments_BT, spec: ContextSpec, window):
        t, heads = q_BTHK.shape[1:3]
        self.groups, self.r, self.window, self.spec = groups, heads // groups, window, spec
        self.q = self.grouped(q_BTHK)
        self.table_CT = jnp.asarray(spec.slot_positions(t * spec.size))
        self.me = jax.lax.axis_index(AXIS)
        self.positions_T = self.table_CT[self.me]
        self.segments_BT = segments_BT
        run = t // spec.chunks_per_device
        self.tq, self.tk = tile_size(run, QUERY_TILE), tile_size(run, KEY_TILE)
        self.nq, self.nk = t // self.tq, t // self.tk

    def grouped(self, x_BTHK):
        """[B, T, H, K] -> [B, G, R, T, K]: query heads under their kv head."""
        b, t, _, head_dim = x_BTHK.shape
        return x_BTHK.reshape(b, t, self.groups, self.r, head_dim).transpose(0, 2, 3, 1, 4)

    def query_tile(self, x_BGRTK, i):
        """Rows of query tile i of a [B, G, R, T, ...] array, heads folded: [B, G, R·tq, ...]."""
        return flash.fold_heads(jax.lax.dynamic_slice_in_dim(x_BGRTK, i * self.tq, self.tq, 3))

    def put_query_tile(self, x_BGRTK, tile_BGQ, i):
        tile = flash.unfold_heads(tile_BGQ, self.r)
        return jax.lax.dynamic_update_slice_in_dim(x_BGRTK, tile, i * self.tq, 3)

    def pairs(self, block, positions_T, i, j):
        """Query tile i against key tile j of a block: (whether any key is visible, the
        mask, the key tile's k and v)."""
        k_BGTK, v_BGTK, segments_BT = block
        q_pos = jax.lax.dynamic_slice_in_dim(self.positions_T, i * self.tq, self.tq)
        k_pos = jax.lax.dynamic_slice_in_dim(positions_T, j * self.tk, self.tk)
        q_ids = k_ids = None
        if segments_BT is not None:
            q_ids = jnp.tile(jax.lax.dynamic_slice_in_dim(self.segments_BT, i * self.tq,
                                                          self.tq, 1), (1, self.r))
            k_ids = jax.lax.dynamic_slice_in_dim(segments_BT, j * self.tk, self.tk, 1)
        any_seen = flash.any_visible(q_pos[0], q_pos[-1], k_pos[0], k_pos[-1], self.window)
        seen = flash.visible(jnp.tile(q_pos, self.r), k_pos, self.window, q_ids, k_ids)
        keys = (jax.lax.dynamic_slice_in_dim(x, j * self.tk, self.tk, 2)
                for x in (k_BGTK, v_BGTK))
        return any_seen, seen, *keys


def _counted(flops: int, me):
    """Reports a computed tile's FLOPs to the active work counter (count_work)."""
    if _COUNTER is not None:
        jax.debug.callback(_COUNTER, me, flops)


_COUNTER = None


def count_work(counter):
    """Within a `with`, every tile the compiled kernel computes calls counter(device index
    along context, FLOPs) as it runs (forward and backward), for measuring the balance of
    the work. The callback is traced into the step: trace and compile it inside the `with`
    (a step compiled before, and cached, counts nothing)."""
    return _CountWork(counter)


class _CountWork:
    def __init__(self, counter):
        self.counter = counter

    def __enter__(self):
        global _COUNTER
        _COUNTER = self.counter

    def __exit__(self, *exc):
        global _COUNTER
        _COUNTER = None


def _fold_block(dev: _Device, acc, block, positions_T):
    """The accumulators (o, m, l: [B, G, R, T, ...] float32) with a key block folded in."""

    def query_tile(i, acc):
        q_BGQK = dev.query_tile(dev.q, i)
        tile = tuple(dev.query_tile(x, i) for x in acc)

        def key_tile(j, tile):
            any_seen, seen, k_BGMK, v_BGMK = dev.pairs(block, positions_T, i, j)

            def fold(tile):
                _counted(flash.tile_flops(q_BGQK, k_BGMK), dev.me)
                return flash.fold(tile, q_BGQK, k_BGMK, v_BGMK, seen)

            return jax.lax.cond(any_seen, fold, lambda tile: tile, tile)

        tile = jax.lax.fori_loop(0, dev.nk, key_tile, tile)
        return tuple(dev.put_query_tile(x, t, i) for x, t in zip(acc, tile))

    return jax.lax.fori_loop(0, dev.nq, query_tile, acc)


def _block_grads(dev: _Device, dq_BGRTK, grads_in, block, positions_T):
    """(dQ with the block's share added, the block's dK and dV), float32."""
    do_BGRTK, lse_BGRT, delta_BGRT = grads_in
    k_BGTK = block[0]

    def key_tile(j, carry):
        def query_tile(i, carry):
            dq_BGRTK, dk_BGMK, dv_BGMK = carry
            any_seen, seen, k_blk, v_blk = dev.pairs(block, positions_T, i, j)

            def grads(carry):
                dq_BGRTK, dk_BGMK, dv_BGMK = carry
                q_BGQK = dev.query_tile(dev.q, i)
                # QKᵀ again, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q and dS·K: 5/2 of the forward's two.
                _counted(flash.tile_flops(q_BGQK, k_blk) * 5 // 2, dev.me)
                dq, dk, dv = flash.tile_grads(
                    q_BGQK, dev.query_tile(do_BGRTK, i), dev.query_tile(lse_BGRT, i),
                    dev.query_tile(delta_BGRT, i), k_blk, v_blk, seen)
                dq_BGRTK = dev.put_query_tile(dq_BGRTK, dev.query_tile(dq_BGRTK, i) + dq, i)
                return dq_BGRTK, dk_BGMK + dk, dv_BGMK + dv

            return jax.lax.cond(any_seen, grads, lambda carry: carry, carry)

        dq_BGRTK, dk_BGTK, dv_BGTK = carry
        b, g, _, head_dim = k_BGTK.shape
        zeros = jnp.zeros((b, g, dev.tk, head_dim), jnp.float32)
        dq_BGRTK, dk, dv = jax.lax.fori_loop(0, dev.nq, query_tile, (dq_BGRTK, zeros, zeros))
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=j * dev.tk,
                                axis=2)
        return dq_BGRTK, put(dk_BGTK, dk), put(dv_BGTK, dv)

    zeros = jnp.zeros(k_BGTK.shape, jnp.float32)
    return jax.lax.fori_loop(0, dev.nk, key_tile, (dq_BGRTK, zeros, zeros))


def _pass_on(tree, size: int):
    """Every array of `tree` to the next device of the ring."""
    shift = [(j, (j + 1) % size) for j in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, shift), tree)


def _blocks(k_BTGK, v_BTGK, segments_BT):
    """This device's K/V block as the kernel visits it: k, v [B, G, T, K], segment ids."""
    return k_BTGK.transpose(0, 2, 1, 3), v_BTGK.transpose(0, 2, 1, 3), segments_BT


def _forward(q_BTHK, k_BTGK, v_BTGK, segments_BT, *, spec: ContextSpec, window):
    """One device's output and logsumexp: its queries against every key block of the row
    (its own, then the others as its variant brings them)."""
    dev = _Device(q_BTHK, k_BTGK.shape[2], segments_BT, spec, window)
    b, g, r, t, head_dim = dev.q.shape
    acc = tuple(flash.unfold_heads(x, r) for x in flash.empty(b, g, r * t, head_dim))
    block = _blocks(k_BTGK, v_BTGK, segments_BT)
    acc = _fold_block(dev, acc, block, dev.positions_T)
    acc = VARIANTS[spec.variant].forward(dev, acc, block)
    out_BGRTK, lse_BGRT = flash.finish(acc)
    out_BTHK = out_BGRTK.transpose(0, 3, 1, 2, 4).reshape(q_BTHK.shape).astype(q_BTHK.dtype)
    return out_BTHK, lse_BGRT


def _ring_forward(dev: _Device, acc, block):
    """The C−1 other blocks, each passed on one hop at a time."""
    size, me = dev.spec.size, dev.me

    def hop(carry, s):
        acc, block = carry
        block = _pass_on(block, size)
        return (_fold_block(dev, acc, block, dev.table_CT[(me - s) % size]), block), None

    (acc, _), _ = jax.lax.scan(hop, (acc, block), jnp.arange(1, size))
    return acc


def _allgather_forward(dev: _Device, acc, block):
    """The row's blocks gathered once, visited in the ring's order."""
    size, me = dev.spec.size, dev.me
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS, axis=0), block)

    def visit(acc, s):
        j = (me - s) % size  # the ring's order, so both variants sum alike
        return _fold_block(dev, acc, jax.tree.map(lambda x: x[j], gathered),
                           dev.table_CT[j]), None

    acc, _ = jax.lax.scan(visit, acc, jnp.arange(1, size))
    return acc


def _backward(q_BTHK, k_BTGK, v_BTGK, segments_BT, out_BTHK, lse_BGRT, dout_BTHK, *,
              spec: ContextSpec, window):
    """One device's dQ, dK, dV: the blocks visited again in the forward's order."""
    dev = _Device(q_BTHK, k_BTGK.shape[2], segments_BT, spec, window)
    # dO stays in the compute dtype for the tiles' matmuls (flash.tile_grads); 16-bit
    # products are exact in float32, so float32 accumulation keeps delta exact.
    do_BGRTK = dev.grouped(dout_BTHK)
    delta_BGRT = jnp.einsum("bgrtk,bgrtk->bgrt", do_BGRTK, dev.grouped(out_BTHK),
                            preferred_element_type=jnp.float32)
    grads_in = (do_BGRTK, lse_BGRT, delta_BGRT)
    block = _blocks(k_BTGK, v_BTGK, segments_BT)
    dq = jnp.zeros(dev.q.shape, jnp.float32)
    own = _block_grads(dev, dq, grads_in, block, dev.positions_T)
    dq, dk_BGTK, dv_BGTK = VARIANTS[spec.variant].backward(dev, grads_in, block, *own)
    dq_BTHK = dq.transpose(0, 3, 1, 2, 4).reshape(q_BTHK.shape).astype(q_BTHK.dtype)
    return (dq_BTHK, dk_BGTK.transpose(0, 2, 1, 3).astype(k_BTGK.dtype),
            dv_BGTK.transpose(0, 2, 1, 3).astype(v_BTGK.dtype))


def _ring_backward(dev: _Device, grads_in, block, dq, dk_BGTK, dv_BGTK):
    """(dQ, this block's dK, dV): each block passed on with the dK/dV summed so far, and
    one last hop home to the block's owner."""
    size, me = dev.spec.size, dev.me

    def hop(carry, s):
        dq, block, dk, dv = carry
        block, dk, dv = _pass_on((block, dk, dv), size)
        dq, dk_s, dv_s = _block_grads(dev, dq, grads_in, block,
                                      dev.table_CT[(me - s) % size])
        return (dq, block, dk + dk_s, dv + dv_s), None

    (dq, _, dk_BGTK, dv_BGTK), _ = jax.lax.scan(hop, (dq, block, dk_BGTK, dv_BGTK),
                                                jnp.arange(1, size))
    dk_BGTK, dv_BGTK = _pass_on((dk_BGTK, dv_BGTK), size)  # home: the block's owner
    return dq, dk_BGTK, dv_BGTK


def _allgather_backward(dev: _Device, grads_in, block, dq, dk_BGTK, dv_BGTK):
    """(dQ, this block's dK, dV): the gathered blocks' dK/dV summed back to their owners
    with one reduce-scatter."""
    size, me = dev.spec.size, dev.me
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS, axis=0), block)
    dk_all = jnp.zeros((size,) + dk_BGTK.shape, jnp.float32).at[me].set(dk_BGTK)
    dv_all = jnp.zeros((size,) + dv_BGTK.shape, jnp.float32).at[me].set(dv_BGTK)

    def visit(carry, s):
        dq, dk_all, dv_all = carry
        j = (me - s) % size
        dq, dk_j, dv_j = _block_grads(dev, dq, grads_in,
                                      jax.tree.map(lambda x: x[j], gathered),
                                      dev.table_CT[j])
        return (dq, dk_all.at[j].add(dk_j), dv_all.at[j].add(dv_j)), None

    (dq, dk_all, dv_all), _ = jax.lax.scan(visit, (dq, dk_all, dv_all),
                                           jnp.arange(1, size))
    dk_BGTK, dv_BGTK = (jax.lax.psum_scatter(x, AXIS, scatter_dimension=0)
                        for x in (dk_all, dv_all))
    return dq, dk_BGTK, dv_BGTK


def check_mesh(c, sizes: dict[str, int]) -> None:
    """What the context kernel (either variant) cannot run: query tiles of a few positions
    (a run with no divisor in MIN_TILE..QUERY_TILE), a pipeline."""
    size = sizes.get("context", 1)
    if size == 1:
        return
    m, runs = c.model, size * (2 if c.mesh.context_load_balance else 1)
    run = m.seq_len // runs
    # A long run with no divisor of MIN_TILE..QUERY_TILE would loop over tiles of a few
    # positions (a prime run: one).
    query_tile = tile_size(run, QUERY_TILE)
    if query_tile < min(run, MIN_TILE):
        fail("model.seq_len", m.seq_len, f"leaves runs of {run} positions per context "
             f"chunk, whose largest divisor up to {QUERY_TILE} is {query_tile}: the attention "
             f"would run in tiles of {query_tile}; pick a length whose run has a divisor in "
             f"{MIN_TILE}..{QUERY_TILE}")
    if c.mesh.pipeline != 1 or c.mesh.dcn_pipeline != 1:
        fail("mesh.pipeline", c.mesh.pipeline, f"mesh.context={size} does not run under a "
             "pipeline yet; use mesh.pipeline=1")


@dataclasses.dataclass(frozen=True)
class ContextVariant:
    """One `model.context_attention` value: how K/V reach every device of a context group,
    its checks, and the facts the planner counts its memory and traffic from."""

    name: str
    doc: str
    forward: Callable  # (device, accumulators, own block) -> accumulators, other blocks in
    backward: Callable  # (device, grads_in, own block, dq, dk, dv) -> (dq, dk, dv)
    grouped_kv: bool  # 'auto' picks it when kv heads are grouped (GQA/MQA), else not
    # (config, mesh axis sizes) -> None, raising ConfigError.
    check: Callable | None = None
    # Planner: K/V blocks a device holds at once (None: the whole row's C blocks),
    kv_blocks: int | None = None
    # and whether the other blocks arrive in C−1 dependent hops (else one collective).
    hops: bool = False

    def validate(self, c, sizes: dict[str, int]) -> None:
        if self.check is not None:
            self.check(c, sizes)


VARIANTS: dict[str, ContextVariant] = {v.name: v for v in (
    ContextVariant("allgather", "the row's K/V all-gathered once, then visited block by "
                   "block", _allgather_forward, _allgather_backward, grouped_kv=True,
                   check=check_mesh),
    ContextVariant("ring", "each block passed on around the ring (lax.ppermute), at most "
                   "two held", _ring_forward, _ring_backward, grouped_kv=False,
                   check=check_mesh, kv_blocks=2, hops=True),
)}


def variant_choices() -> tuple[str, ...]:
    """model.context_attention's valid values (read when asked)."""
    return ("auto", *VARIANTS)


def resolve_variant(name: str, num_heads: int, num_kv_heads: int) -> str:
    """`auto`: the variant for grouped kv heads (GQA/MQA: K/V are a fraction of the
    activations, so holding the row's K/V costs little and one collective replaces C−1
    dependent hops: allgather), else the other (each hop's transfer overlaps a block's
    compute, and a device holds only two K/V blocks: ring)."""
    if name != "auto":
        return name
    grouped = num_kv_heads < num_heads
    return next(v.name for v in VARIANTS.values() if v.grouped_kv == grouped)


def computed_scores(spec: ContextSpec, length: int, window: int | None = None) -> np.ndarray:
    """[C]: the query×key scores each device's kernel computes per row and head (the
    (query tile, key tile) pairs the kernel does not skip, masked parts included): the work
    the step waits on, as count_work measures it in the compiled step."""
    positions_CT = spec.slot_positions(length)
    run = positions_CT.shape[1] // spec.chunks_per_device
    tq, tk = tile_size(run, QUERY_TILE), tile_size(run, KEY_TILE)
    work = np.zeros(spec.size, np.int64)
    for i in range(spec.size):
        for j in range(spec.size):
            for q in np.split(positions_CT[i], len(positions_CT[i]) // tq):
                for k in np.split(positions_CT[j], len(positions_CT[j]) // tk):
                    if flash.any_visible(q[0], q[-1], k[0], k[-1], window):
                        work[i] += len(q) * len(k)
    return work
