"""The layer stack as groups, and the one walker that runs them for training and decoding.

A group is `dense` dense layers then, in an MoE model, one MoE layer: model.moe.every_n_layers
layers, n−1 dense and the n-th MoE. A dense model is groups of one dense layer and no MoE
layer, so its walk stays one scan over the stacked layers. The parameters stay stored by
kind (`blocks`, `moe_blocks`, each [layers, ...]); the walker views them per group. One scan
step per group keeps the scan where stacking all layers alike cannot (the two kinds have
different parameters), and lets the pipeline split the groups.

Layer kinds (model.layer_types: sliding or full attention, each with its rope) are runs:
each maximal run of groups of one kind is one scan, its kind a static argument of the
layer, so every kernel keeps its static window (the chunked kernel skips the blocks outside
it, cuDNN and splash build their masks once). Carrying the kind as scanned data instead
would keep one compiled body, but the window would then be a traced value: the kernels
could only mask, not skip, and the ones that need a static window could not run. So a
pattern that repeats compiles one body per run of one period (walk): 5 sliding : 1 full is
2 bodies, and so is an alternating pattern, whatever the depth. A model without a pattern
is one run, the scan as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Groups:
    count: int  # groups: the walker's scan steps
    dense: int  # dense layers per group: one is the layer itself, more an inner scan
    moe: bool  # whether each group ends in an MoE layer
    # (layer kind or None: no pattern, first group, end group) of each run of equal kinds
    runs: tuple[tuple[str | None, int, int], ...] = ()
    # Dense layers before the first group (model.moe.first_dense_layers), stored first in
    # `blocks` and walked as groups of their own (`head`) before these.
    prefix: int = 0

    @classmethod
    def of(cls, spec) -> Groups:
        prefix = 0
        if spec.moe is None:
            count, dense, moe = spec.num_layers, 1, False
        else:
            n, prefix = spec.moe.every_n_layers, spec.moe.first_dense_layers
            count, dense, moe = spec.moe.layers(spec.num_layers), n - 1, True
        # Each group is of one kind (config.py checks it): its first layer's.
        kinds = spec.layer_types[::dense + moe] if spec.layer_types else (None,) * count
        return cls(count, dense, moe, cls.runs_of(kinds), prefix)

    @property
    def head(self) -> Groups | None:
        """The dense prefix as groups of one dense layer (None: no prefix)."""
        return Groups(self.prefix, 1, False) if self.prefix else None

    @staticmethod
    def runs_of(kinds) -> tuple[tuple[str | None, int, int], ...]:
        """(kind, first, end) of each maximal run of equal kinds in `kinds`."""
        runs, first = [], 0
        for g in range(1, len(kinds) + 1):
            if g == len(kinds) or kinds[g] != kinds[first]:
                runs.append((kinds[first], first, g))
                first = g
        return tuple(runs)

    @property
    def size(self) -> int:
        return self.dense + self.moe

    def moe_layers(self) -> np.ndarray:
        """Which of the model's layers (in order) are MoE: bool [layers]."""
        return np.concatenate([np.zeros(self.prefix, bool),
                               np.tile(np.arange(self.size) >= self.dense, self.count)])

    def by_group(self, tree):
        """A kind's stacked leaves [groups·k, ...] as [groups, k, ...] (k > 1) or as they are."""
        k = self.dense
        if k <= 1:
            return tree
        return jax.tree.map(lambda a: a.reshape(self.count, k, *a.shape[1:]), tree)

    def split(self, tree) -> dict:
        """Per-layer leaves [layers, ...] (the kv cache) as the walker reads them:
        {"dense": [groups(, dense), ...], "moe": [groups, ...]}, and a dense prefix's
        leaves under "prefix" ([prefix, ...])."""
        if self.prefix:
            rest = dataclasses.replace(self, prefix=0).split(
                jax.tree.map(lambda a: a[self.prefix:], tree))
            return {"prefix": jax.tree.map(lambda a: a[:self.prefix], tree), **rest}
        kinds = self._kinds()
        if len(kinds) == 1:  # every layer of one kind: already in order
            return {kinds[0][0]: tree}

        def part(a, lo, hi):
            a = a.reshape(self.count, self.size, *a.shape[1:])[:, lo:hi]
            return a[:, 0] if hi - lo == 1 else a

        return {kind: jax.tree.map(lambda a: part(a, lo, hi), tree) for kind, lo, hi in kinds}

    def join(self, parts: dict):
        """split's inverse: per-layer leaves [layers, ...] in the model's order."""
        if self.prefix:
            rest = dataclasses.replace(self, prefix=0).join(
                {k: v for k, v in parts.items() if k != "prefix"})
            return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), parts["prefix"], rest)
        kinds = self._kinds()
        if len(kinds) == 1:
            return parts[kinds[0][0]]

        def whole(*pieces):
            pieces = [p if hi - lo > 1 else p[:, None] for p, (_, lo, hi) in zip(pieces, kinds)]
            a = jnp.concatenate(pieces, axis=1)
            return a.reshape(-1, *a.shape[2:])

        return jax.tree.map(whole, *(parts[kind] for kind, _, _ in kinds))

    def _kinds(self) -> list[tuple[str, int, int]]:
        """(kind, first, end) of each kind's layers within a group."""
        kinds = [("dense", 0, self.dense)] if self.dense else []
        return kinds + [("moe", self.dense, self.size)] if self.moe else kinds


def stacked(block_cls, spec, keys: jax.Array):
    """Layers created with nnx.vmap: one stacked parameter per weight, axis `layers` first."""
    blocks = nnx.vmap(lambda key: block_cls(spec, rngs=nnx.Rngs(key)))(keys)
    for _, var in nnx.iter_graph(blocks):
        if isinstance(var, nnx.Variable):
            var.set_metadata("axes", ("layers",) + var.get_metadata()["axes"])
    return blocks


def walk(groups: Groups, layer: Callable, carry, xs):
    """Runs the dense prefix (xs["prefix"], as dense layers: groups.head), then the groups:
    ((x, aux sums), ys), the prefix's ys under "prefix" as Groups.split lays them out."""
    if not groups.prefix:
        return _walk_groups(groups, layer, carry, xs)
    xs = dict(xs)
    carry, head_ys = _walk_groups(groups.head, layer, carry, {"dense": xs.pop("prefix")})
    carry, ys = _walk_groups(groups, layer, carry, xs)
    return carry, {"prefix": head_ys["dense"], **ys}


def _walk_groups(groups: Groups, layer: Callable, carry, xs):
    """Runs the groups, one scan per run of equal layer kinds: ((x, aux sums), ys).

    layer(kind, x, layer_xs, layer_kind, view=None) -> (x, aux, y) runs one layer of `kind`
    ("dense", "moe") and of `layer_kind` (its model.layer_types entry; None: no pattern) on
    view(layer_xs) (layer_xs itself when view is None), its slice of xs[kind] (its state,
    and its kv cache when decoding); the layer takes the view inside its remat, so that
    what its backward pass keeps is layer_xs. y is what the layer emits (its new cache),
    aux its pytree of per-row stats ({} for a dense layer).
    carry: (x, aux sums); the sums ({} to drop them) are [B, groups, ...], group g's MoE
    layer's aux added at slot xs["index"] = g, so that they ride with their rows (the
    pipeline's buffers carry them from stage to stage).

    A pattern that repeats (5 sliding : 1 full, or alternating) is one outer scan over its
    periods, whose body runs the period's own runs (an inner scan each): one compiled body
    per run of a period rather than per run of the model (2 for Gemma 3's 48 layers, not
    16; 2 for gpt-oss's alternating 24, not 24); what is left past the last whole period is
    walked run by run.
    """
    runs = groups.runs or ((None, 0, groups.count),)
    if len(runs) == 1:  # one kind (or no pattern): the one scan over every group
        return jax.lax.scan(_group_body(groups, layer, runs[0][0]), carry, xs)
    period = _period(runs, groups.count)
    ys, first = [], 0
    if period is not None:
        inner, length, reps = period
        first = length * reps
        periods_xs = jax.tree.map(
            lambda a: a[:first].reshape(reps, length, *a.shape[1:]), xs)

        def one_period(carry, period_xs):
            if groups.dense > 1:  # (an inner dense scan per group: its own xs, sliced)
                return _walk_runs(groups, layer, carry, period_xs, inner)
            return _walk_by_index(groups, layer, carry, period_xs, inner)

        carry, period_ys = jax.lax.scan(one_period, carry, periods_xs)
        ys.append(jax.tree.map(lambda a: a.reshape(first, *a.shape[2:]), period_ys))
    tail = [(kind, max(lo, first) - first, hi - first) for kind, lo, hi in runs if hi > first]
    if tail:
        carry, tail_ys = _walk_runs(groups, layer, carry,
                                    jax.tree.map(lambda a: a[first:], xs), tail)
        ys.append(tail_ys)
    return carry, jax.tree.map(lambda *parts: jnp.concatenate(parts), *ys)


def _walk_runs(groups: Groups, layer: Callable, carry, xs, runs):
    """The groups of xs (leaves [groups, ...]) run by run: a scan per run of several
    groups, a call for a run of one. ys as [groups, ...]."""
    ys = []
    for kind, lo, hi in runs:
        run_xs = jax.tree.map(lambda a: a[lo:hi], xs)
        if hi - lo > 1:
            carry, run_ys = jax.lax.scan(_group_body(groups, layer, kind), carry, run_xs)
        else:
            carry, run_ys = _group_body(groups, layer, kind)(
                carry, jax.tree.map(lambda a: a[0], run_xs))
            run_ys = jax.tree.map(lambda a: a[None], run_ys)
        ys.append(run_ys)
    return carry, jax.tree.map(lambda *parts: jnp.concatenate(parts), *ys)


def _walk_by_index(groups: Groups, layer: Callable, carry, xs, runs):
    """_walk_runs over one period's xs (leaves [period, ...]), each layer reading its slice
    inside its remat (the layer's `view`). What the backward pass keeps of the weights is
    then the outer scan's xs itself: slicing them here instead made the period scan stack a
    copy of each run's weights and gradients (gpt-oss-20b: 85 GB a device, not 68)."""
    ys = []
    for kind, lo, hi in runs:
        body = _group_body(groups, layer, kind, source=xs)
        if hi - lo > 1:
            carry, run_ys = jax.lax.scan(body, carry, jnp.arange(lo, hi))
        else:
            carry, run_ys = body(carry, lo)
            run_ys = jax.tree.map(lambda a: a[None], run_ys)
        ys.append(run_ys)
    return carry, jax.tree.map(lambda *parts: jnp.concatenate(parts), *ys)


def _period(runs, count: int):
    """(the runs of one period, its length, whole periods) of the shortest period the
    groups' kinds repeat with, at least twice, when walking by periods compiles fewer
    bodies than walking by runs; else None."""
    kinds = [kind for kind, lo, hi in runs for _ in range(lo, hi)]
    for length in range(2, count // 2 + 1):
        reps = count // length
        if any(kinds[i] != kinds[i % length] for i in range(reps * length)):
            continue
        inner = Groups.runs_of(kinds[:length])
        tail = len(Groups.runs_of(kinds[reps * length:]))
        if len(inner) + tail < len(runs):
            return inner, length, reps
        return None
    return None


def _group_body(groups: Groups, layer: Callable, layer_kind: str | None,
                source=None) -> Callable:
    """The scan body of one group of `layer_kind`'s layers: over the group's own xs, or
    (source given, groups.dense ≤ 1) over group indices into source, which each layer reads
    through its view."""
    def dense(x, layer_xs):
        x, _, y = layer("dense", x, layer_xs, layer_kind)
        return x, y

    def group(carry, xs):
        x, sums = carry
        ys, own, view = {}, xs, None
        if source is not None:
            own, index = source, xs

            def view(tree):
                return jax.tree.map(lambda a: a[index], tree)
        if groups.dense > 1:
            x, ys["dense"] = jax.lax.scan(dense, x, own["dense"])
        elif groups.dense:
            x, _, ys["dense"] = layer("dense", x, own["dense"], layer_kind, view)
        if groups.moe:
            x, aux, ys["moe"] = layer("moe", x, own["moe"], layer_kind, view)
            slot = own.get("index")
            sums = _add_at(sums, aux, slot if view is None else view(slot), groups.count)
        return (x, sums), ys

    return group


def _add_at(sums: dict, aux: dict, index, count: int) -> dict:
    """sums [B, groups, ...] + aux [B, ...] at slot `index` (a one-hot product rather than a
    scatter: under the pipeline the slot is per stage)."""
    if not sums:
        return sums
    slot_N = jax.nn.one_hot(index, count, dtype=jnp.float32)
    return {k: acc + jnp.expand_dims(aux[k], 1)
            * slot_N.reshape((1, count) + (1,) * (aux[k].ndim - 1))
            for k, acc in sums.items()}


def stack_of(kind: str | None) -> str:
    """The parameter stack a layer kind's layers live in: linear-attention layers apart
    (their parameters differ), every attention kind in `blocks`."""
    return "linear_blocks" if kind == "linear_attention" else "blocks"


def walk_mixed(kinds: tuple[str, ...], layer: Callable, x, xs: dict):
    """The layers of a model whose stacks differ in parameters (Gated DeltaNet beside
    attention): (x, ys {stack: [its layers, ...]}). xs: {stack: leaves [its layers, ...]};
    layer(kind, x, layer_xs) -> (x, y). Runs of equal kinds are a scan each; a pattern that
    repeats (3 linear : 1 full) is one outer scan over its periods, so a period's runs
    compile once whatever the depth (as walk does)."""
    n = len(kinds)
    length = next((p for p in range(1, n // 2 + 1)
                   if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n))), n)
    reps, period = n // length, kinds[:length]
    counts = {stack_of(k): sum(stack_of(j) == stack_of(k) for j in period) for k in period}
    by_rep = {s: jax.tree.map(lambda a, c=c: a.reshape(reps, c, *a.shape[1:]), xs[s])
              for s, c in counts.items()}

    def one_period(x, rep_xs):
        seen, ys = dict.fromkeys(counts, 0), {s: [] for s in counts}
        for kind, lo, hi in Groups.runs_of(period):
            s = stack_of(kind)
            run_xs = jax.tree.map(lambda a, i=seen[s], m=hi - lo: a[i:i + m], rep_xs[s])
            seen[s] += hi - lo
            if hi - lo > 1:
                x, y = jax.lax.scan(lambda x, lx, kind=kind: layer(kind, x, lx), x, run_xs)
            else:
                x, y = layer(kind, x, jax.tree.map(lambda a: a[0], run_xs))
                y = jax.tree.map(lambda a: a[None], y)
            ys[s].append(y)
        return x, {s: jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
                   for s, parts in ys.items()}

    if reps == 1:
        return one_period(x, jax.tree.map(lambda a: a[0], by_rep))
    x, ys = jax.lax.scan(one_period, x, by_rep)
    return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), ys)
