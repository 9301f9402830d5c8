"""Pipeline parallelism inside the one compiled step: GPipe and circular schedules.

The layer stack (L layers, stored in order with its `layers` axis sharded over the `pipeline`
mesh axis) is viewed as [repeats v, stages p, Lc] with layer (r·p + s)·Lc + l on stage s.
A rotating buffer holds one micro-batch per stage; each iteration every stage runs its
current chunk (a vmap over the stage axis, sharded over `pipeline`), then the buffer shifts by
one stage (jnp.roll on a pipeline-sharded axis: XLA emits a collective-permute). Stage 0
takes a new micro-batch, or, in the circular schedule, one coming back from the last stage
for its next repeat. Autodiff through the loop gives the backward pass (activations travel
back with the transposed permute).

Micro-batch i's repeat r reaches stage s at iteration r·m + i + s, so the loop takes
v·m + p − 1 iterations of which p − 1 are fill and drain: the bubble (p−1)/(v·m+p−1).
GPipe is v = 1 (each stage one contiguous block); circular needs m ≥ p so that a micro-batch
leaving the last stage is stored until stage 0 is free for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxtrain.errors import fail
from jaxtrain.mesh import constrain


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    stages: int
    repeats: int
    microbatches: int

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        return (self.stages - 1) / self.iterations


def _check_gpipe(c, stages: int) -> None:
    if c.pipeline.repeats != 1:
        fail("pipeline.repeats", c.pipeline.repeats, "the gpipe schedule has one chunk per "
             "stage: use 1, or pipeline.schedule='circular'")


def _check_circular(c, stages: int) -> None:
    pc = c.pipeline
    if pc.repeats < 2:
        fail("pipeline.repeats", pc.repeats, "the circular schedule needs >= 2 chunks per stage")
    if stages > 1 and pc.microbatches < stages:
        fail("pipeline.microbatches", pc.microbatches,
             f"the circular schedule needs at least mesh.pipeline={stages} micro-batches")


def _check_stages(c, stages: int) -> None:
    """What every schedule needs of the model: layers (and MoE layer groups) that divide
    into mesh.pipeline × pipeline.repeats equal chunks."""
    pc = c.pipeline
    chunks = stages * pc.repeats
    layers = c.model.num_layers
    if c.model.moe.num_experts and c.model.moe.first_dense_layers:
        fail("model.moe.first_dense_layers", c.model.moe.first_dense_layers, "the pipeline "
             "splits the MoE groups, not a dense prefix before them; use 0 or mesh.pipeline=1")
    if c.model.moe.num_experts and c.model.moe.every_n_layers > 1:
        # The pipeline splits the groups of every_n_layers layers the model scans over.
        groups = layers // c.model.moe.every_n_layers
        if groups % chunks:
            fail("model.moe.every_n_layers", c.model.moe.every_n_layers,
                 f"the {groups} groups of layers (one MoE layer each) must divide into "
                 f"mesh.pipeline×pipeline.repeats={stages}×{pc.repeats} equal stages")
    if layers % chunks:
        below, above = layers - layers % chunks, layers + chunks - layers % chunks
        options = [str(n) for n in (below, above) if n > 0]
        repeats = [r for r in range(2, layers + 1) if layers % (stages * r) == 0]
        hint = f"; or pipeline.repeats in {repeats}" if repeats and pc.repeats > 1 else ""
        fail("model.num_layers", layers, f"must divide into mesh.pipeline×pipeline.repeats="
             f"{stages}×{pc.repeats} equal stages: use {' or '.join(options)}{hint}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One `pipeline.schedule` value. Every schedule runs in `pipeline` below, which the
    number of chunks per stage (pipeline.repeats) shapes; the entry says which repeats it
    takes (its check: (config, stages) -> None, raising ConfigError)."""

    name: str
    doc: str
    check: Callable

    def validate(self, c, sizes: dict[str, int]) -> None:
        if c.pipeline.microbatches < 1:
            fail("pipeline.microbatches", c.pipeline.microbatches, "must be >= 1")
        self.check(c, sizes["pipeline"])
        if sizes["pipeline"] > 1:
            _check_stages(c, sizes["pipeline"])


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "one contiguous block of layers per stage (pipeline.repeats=1)",
             _check_gpipe),
    Schedule("circular", "pipeline.repeats chunks per stage, visited in turn (a smaller "
             "bubble; needs micro-batches >= stages)", _check_circular),
)}


def defaults() -> dict:
    """The `pipeline` section of config.base_config(): used when mesh.pipeline > 1
    (docs/parallelism.md)."""
    return {
        "schedule": "gpipe",
        # Pipeline micro-batches: the slices of each (accumulation) micro-batch that flow
        # through the stages; not train.microbatches, which is gradient accumulation.
        "microbatches": 4,
        "repeats": 1,  # layer chunks per stage; circular only
    }


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
    return PipelineSpec(stages, repeats, microbatches).bubble


def microbatches_for_bubble(stages: int, repeats: int, target: float = 0.1) -> int:
    """The fewest micro-batches whose bubble is under `target`."""
    m = 1
    while bubble_fraction(stages, repeats, m) >= target:
        m += 1
    return m


def pipeline(stage_fn: Callable, stacked, x, spec: PipelineSpec, rules, side=None):
    """Runs x through all layers of `stacked` (leaves [L, ...]) on the pipeline schedule.

    x: the activations x_BLD, or a pytree whose first leaf is x_BLD and whose other leaves
    are per-row values [B, ...] that travel with their rows (MoE routing stats).
    stage_fn(chunk, x[, side]) applies one chunk of Lc stacked layers (leaves [Lc, ...]);
    side: per-row inputs every layer reads (a pytree of [B, ...] arrays, e.g. packed
    documents' segment ids and positions; None: stage_fn takes (chunk, x) only), of which
    each stage gets its micro-batch's rows: micro-batch i is on stage s at iterations
    r·m + i + s, so stage s takes rows of micro-batch (t − s) mod m, gathered where they lie
    rather than carried.
    """
    # One function of ~70 lines on purpose: the scan body closes over the schedule's shapes
    # and the split inputs; cut apart, each piece would take most of them as arguments.
    p, v, m = spec.stages, spec.repeats, spec.microbatches
    tmap = jax.tree.map
    b = jax.tree.leaves(x)[0].shape[0]
    mb = b // m
    layers = jax.tree.leaves(stacked)[0].shape[0]
    chunk = layers // (p * v)
    # [L, ...] -> [v, p, Lc, ...]; for GPipe (v = 1) this is a free reshape of the stored
    # pipeline-sharded layout, for circular a relayout of the weights (see docs).
    chunks = tmap(lambda a: a.reshape(v, p, chunk, *a.shape[1:]), stacked)
    # Micro-batch i takes rows i, i+m, ...: no data moves between devices to split the batch.
    inputs_M = tmap(lambda a: a.reshape(mb, m, *a.shape[1:]).swapaxes(0, 1), x)
    side_M = tmap(lambda a: a.reshape(mb, m, *a.shape[1:]).swapaxes(0, 1), side)

    def constrain_buffer(buffer):
        leaves, treedef = jax.tree.flatten(buffer)
        axes = [("stage", "batch", "sequence", "embed")] + [
            ("stage", "batch") + (None,) * (a.ndim - 2) for a in leaves[1:]]
        return treedef.unflatten([constrain(a, ax, rules) for a, ax in zip(leaves, axes)])

    # Without side inputs stage_fn takes (chunk, x) only.
    run_stages = jax.vmap(stage_fn if side is not None else lambda c, x, _: stage_fn(c, x),
                          in_axes=(0, 0, 0), spmd_axis_name="pipeline")
    stage_ids = jnp.arange(p)

    def iteration(carry, t):
        buffer_P, stored_M = carry
        # Stage 0's input: micro-batch t % m, fresh on its first repeat, else stored.
        i, r = t % m, t // m
        first = tmap(lambda a: a[i], inputs_M) if v == 1 else tmap(
            lambda a, s: jnp.where(r == 0, a[i], s[i]), inputs_M, stored_M)
        buffer_P = constrain_buffer(tmap(lambda a, f: a.at[0].set(f), buffer_P, first))
        # Every stage runs the chunk of the repeat its micro-batch is on.
        repeat_P = jnp.clip((t - stage_ids) // m, 0, v - 1)
        params = tmap(lambda a: jax.vmap(lambda a_v, r_: a_v[r_], in_axes=(1, 0))(
            a, repeat_P), chunks) if v > 1 else tmap(lambda a: a[0], chunks)
        side_P = tmap(lambda a: constrain(
            a[(t - stage_ids) % m], ("stage", "batch") + (None,) * (a.ndim - 2), rules),
            side_M)
        out_P = run_stages(params, buffer_P, side_P)
        # The last stage finished micro-batch k = t - (p-1) of repeat k // m: emitted as this
        # iteration's output (not carried, which would keep a copy per iteration for the
        # backward pass), and stored for its next repeat in the circular schedule.
        last = tmap(lambda a: a[p - 1], out_P)
        if v > 1:
            k = t - (p - 1)
            done_i, valid = k % m, (k >= 0) & (k < (v - 1) * m)
            stored_M = tmap(lambda s, a: s.at[done_i].set(jnp.where(valid, a, s[done_i])),
                            stored_M, last)
        # Shift to the next stage: a collective-permute over the pipeline axis.
        buffer_P = tmap(lambda a: jnp.roll(a, 1, axis=0), out_P)
        return (buffer_P, stored_M), last

    zeros = tmap(lambda a: jnp.zeros((p, mb, *a.shape[1:]), a.dtype), x)
    # Only the circular schedule needs to store micro-batches between repeats.
    stored = tmap(jnp.zeros_like, inputs_M) if v > 1 else tmap(
        lambda a: jnp.zeros((m, 0, *a.shape[1:]), a.dtype), x)
    _, emitted_T = jax.lax.scan(iteration, (zeros, stored), jnp.arange(spec.iterations))
    # Micro-batch i's last repeat leaves the last stage at iteration (v-1)·m + i + p - 1.
    return tmap(lambda e: e[(v - 1) * m + p - 1:].swapaxes(0, 1).reshape(b, *e.shape[2:]),
                emitted_T)
