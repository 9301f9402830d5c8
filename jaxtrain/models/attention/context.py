"""Causal attention with the sequence split over the `context` mesh axis (parallel/context.py).

Inside a shard_map over the mesh each device holds the queries, keys and values of its T =
L/C slots (and of its examples and heads, split as the logical rules say). Its queries must
meet every key block of the row: its own block first, then the others as its
`model.context_attention` variant brings them (context_variants.py: all-gathered once, or
passed around a ring). Each visited block is folded into the device's output in tiles
(context_tiles.py, with flash.py's online softmax), so the largest array the kernel makes
is one [query tile, key tile] score matrix, whatever the length.

Backward: the custom VJP the package's kernels share (scaffold.recomputing_vjp). The
residuals are q, k, v, the output and its logsumexp; the backward visits the blocks again in
the same order, recomputing each tile's probabilities. Autodiff through the forward loop
would keep the float32 accumulators of every hop, C times the output's size per layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.mesh import logical_to_spec
from jaxtrain.models.attention import flash
from jaxtrain.models.attention.context_tiles import AXIS, Device, block_grads, fold_block
from jaxtrain.models.attention.context_variants import VARIANTS
from jaxtrain.models.attention.scaffold import (
    from_groups,
    recomputing_vjp,
    swap_length_and_groups,
    to_groups,
    unfold_heads,
    ungrouped_grads,
)
from jaxtrain.parallel.context import ContextSpec


def context_attention(q_BLHK, k_BLGK, v_BLGK, window: int | None, segments_BL,
                      spec: ContextSpec, rules) -> jax.Array:
    """Causal GQA attention (q already scaled), the sequence in `spec`'s layout and sharded
    over `context`; the contract of models/attention/kernels.py otherwise."""
    q_spec = logical_to_spec(("batch", "length", "heads", "kv"), rules)
    kv_spec = logical_to_spec(("batch", "length", "kv_heads", "kv"), rules)
    if q_spec[1] != AXIS or kv_spec[1] != AXIS:
        raise ValueError(f"context attention needs the `length` rule on `{AXIS}`; the rules "
                         f"give {q_spec}")
    return _attention(q_BLHK, k_BLGK, v_BLGK, segments_BL, None, spec, window, rules)


class _Specs:
    """How the kernel's arrays are split over the mesh (from the logical rules): q and the
    output [B, L, H, K], k and v [B, L, G, K], segment ids [B, L], logsumexp [B, G, R, L]."""

    def __init__(self, rules, segments: bool):
        self.q = logical_to_spec(("batch", "length", "heads", "kv"), rules)
        self.kv = logical_to_spec(("batch", "length", "kv_heads", "kv"), rules)
        self.ids = P(self.q[0], AXIS) if segments else None
        self.lse = P(self.q[0], self.kv[2], None, AXIS)


def _sharded_forward(q_BLHK, k_BLGK, v_BLGK, segments_BL, spec, window, rules):
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
    return run(q_BLHK, k_BLGK, v_BLGK, segments_BL)


def _sharded_backward(spec, window, rules, residuals, dout_BLHK):
    specs = _Specs(rules, residuals[3] is not None)
    run = jax.shard_map(functools.partial(_backward, spec=spec, window=window),
                        in_specs=(specs.q, specs.kv, specs.kv, specs.ids, specs.q, specs.lse,
                                  specs.q),
                        out_specs=(specs.q, specs.kv, specs.kv), check_vma=False)
    return run(*residuals, dout_BLHK)


# The VJP wraps the shard_maps rather than sitting inside one: differentiating a shard_map
# inside the layers' scan linearises its body, and a custom VJP there was differentiated
# through (every tile's scores kept as scan residuals), not used. Statics: (spec, window,
# rules).
_attention = recomputing_vjp(_sharded_forward, _sharded_backward, statics=3)


def _block(k_BTGK, v_BTGK, segments_BT):
    """This device's K/V block as the kernel visits it: k, v [B, G, T, K], segment ids."""
    return swap_length_and_groups(k_BTGK), swap_length_and_groups(v_BTGK), segments_BT


def _forward(q_BTHK, k_BTGK, v_BTGK, segments_BT, *, spec: ContextSpec, window):
    """One device's output and logsumexp: its queries against every key block of the row
    (its own, then the others as its variant brings them)."""
    dev = Device(q_BTHK, k_BTGK.shape[2], segments_BT, spec, window)
    b, g, r, t, head_dim = dev.q.shape
    acc = tuple(unfold_heads(x, r) for x in flash.empty(b, g, r * t, head_dim))
    block = _block(k_BTGK, v_BTGK, segments_BT)
    acc = fold_block(dev, acc, block, dev.positions_T)
    acc = VARIANTS[spec.variant].forward(dev, acc, block)
    out_BGRTK, lse_BGRT = flash.finish(acc)
    return from_groups(out_BGRTK).astype(q_BTHK.dtype), lse_BGRT


def _backward(q_BTHK, k_BTGK, v_BTGK, segments_BT, out_BTHK, lse_BGRT, dout_BTHK, *,
              spec: ContextSpec, window):
    """One device's dQ, dK, dV: the blocks visited again in the forward's order."""
    dev = Device(q_BTHK, k_BTGK.shape[2], segments_BT, spec, window)
    # dO stays in the compute dtype for the tiles' matmuls (flash.tile_grads); 16-bit
    # products are exact in float32, so float32 accumulation keeps delta exact.
    do_BGRTK = to_groups(dout_BTHK, dev.groups)
    delta_BGRT = jnp.einsum("bgrtk,bgrtk->bgrt", do_BGRTK, to_groups(out_BTHK, dev.groups),
                            preferred_element_type=jnp.float32)
    grads_in = (do_BGRTK, lse_BGRT, delta_BGRT)
    block = _block(k_BTGK, v_BTGK, segments_BT)
    dq = jnp.zeros(dev.q.shape, jnp.float32)
    own = block_grads(dev, dq, grads_in, block, dev.positions_T)
    dq, dk_BGTK, dv_BGTK = VARIANTS[spec.variant].backward(dev, grads_in, block, *own)
    return ungrouped_grads(dq, dk_BGTK, dv_BGTK, q_BTHK, k_BTGK, v_BTGK)
