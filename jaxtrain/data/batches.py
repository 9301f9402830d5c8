"""grain pipelines: per-process batches addressed by step, assembled into global arrays.

The batch of step s is a pure function of (seed, s): item s of a shuffled, repeated, batched
MapDataset. A run that resumes at step s therefore reads exactly the batches an uninterrupted
run would have, with nothing to checkpoint but the step.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.data.sources import SOURCES
from jaxtrain.errors import DataError

__all__ = ["Batches", "make_batches", "to_global"]


@dataclasses.dataclass
class Batches:
    """The run's data: a train stream from any step and a fixed list of validation batches."""

    train_source: object
    val_source: object
    global_batch: int
    seed: int
    prefetch: int
    eval_batches: int

    @property
    def local_batch(self) -> int:
        return self.global_batch // jax.process_count()

    def train_iter(self, start_step: int) -> Iterator[np.ndarray]:
        """This process's slices of the global batches of steps start_step, start_step+1, ..."""
        count, index = jax.process_count(), jax.process_index()
        ds = self._dataset(self.train_source, self.seed).batch(self.local_batch,
                                                               drop_remainder=True)
        ds = ds[start_step * count + index::count]
        # A thread per prefetched batch (at least 2): batches are read concurrently, which
        # hides the latency of data on object storage (docs/data.md); order is unchanged.
        options = grain.ReadOptions(num_threads=max(2, self.prefetch),
                                    prefetch_buffer_size=self.prefetch)
        return iter(ds.to_iter_dataset(options))

    def val_batches(self) -> list:
        """This process's slices of the validation batches: eval_batches of them, or as many
        whole global batches as the split holds, so that no row counts twice in val_loss
        (said in one line when that is fewer than asked)."""
        count, index = jax.process_count(), jax.process_index()
        ds = self._dataset(self.val_source, None)
        ds = ds.batch(self.local_batch, drop_remainder=True)[index::count]
        batches = self.eval_batches
        if (line := self._fewer_val_batches()) is not None:
            batches = max(1, len(self.val_source) // self.global_batch)
            if index == 0:
                print(line, file=sys.stderr)
        return [ds[i] for i in range(batches)]

    def _fewer_val_batches(self) -> str | None:
        """The line saying that the validation split holds fewer rows than eval_batches
        global batches; None when it holds enough (or is a mixture of unknown length)."""
        rows = len(self.val_source) if hasattr(self.val_source, "__len__") else None
        if rows is None or rows >= self.eval_batches * self.global_batch:
            return None
        asked = f"eval_batches={self.eval_batches} batches of {self.global_batch} rows"
        if rows < self.global_batch:
            return (f"jaxtrain: warning: the validation split holds {rows} rows, fewer than "
                    f"one batch of {self.global_batch}: {asked} are cut to 1, in which some "
                    "rows count more than once")
        used = rows // self.global_batch
        return (f"jaxtrain: the validation split holds {rows} rows: {used} of the "
                f"{asked} are used, each row at most once")

    @staticmethod
    def _dataset(source, seed: int | None) -> grain.MapDataset:
        """The infinite row stream of a source: repeated, and shuffled when seed is given. A
        source with its own `grain_dataset(seed)` (a mixture) builds it itself."""
        if hasattr(source, "grain_dataset"):
            return source.grain_dataset(seed)
        ds = grain.MapDataset.source(source).repeat(None)
        return ds if seed is None else ds.shuffle(seed=seed)


def make_batches(cfg) -> Batches:
    if cfg.train.global_batch % jax.process_count():
        raise DataError(f"train.global_batch={cfg.train.global_batch} must divide by the "
                        f"{jax.process_count()} processes")
    train, val = SOURCES[cfg.data.source].splits(cfg)
    if jax.process_index() == 0:
        for line in cut_warnings(train, val):
            print(line, file=sys.stderr)
    return Batches(train, val, cfg.train.global_batch, cfg.seed, cfg.data.prefetch,
                   cfg.eval_batches)


def to_global(local_batch, sharding: NamedSharding):
    """This process's rows -> global arrays: a token array, or each array of a Packed batch
    (jaxtrain.data.packing), all sharded alike."""
    return jax.tree.map(lambda rows: jax.make_array_from_process_local_data(sharding, rows),
                        local_batch)


def cut_warnings(*sources) -> list[str]:
    """One line for each split of a chat dataset whose conversations are longer than a row
    (packing.PackedDocuments.cut_documents): prepare's --max-length skips them, and without
    it they would be cut without a word."""
    lines = []
    for source in sources:
        for rows in getattr(source, "sources", [source]):  # a mixture's components
            count, longest = rows.cut_documents() if hasattr(rows, "cut_documents") else (0, 0)
            if count:
                lines.append(
                    f"jaxtrain: warning: {rows.name}: {count:,} conversation(s) longer than a "
                    f"row of model.seq_len+1={rows.capacity} tokens (the longest {longest:,}) "
                    "are cut into pieces, the pieces after the first without their prompt; "
                    f"prepare with --max-length {rows.capacity} to skip them, or raise "
                    "model.seq_len")
    return lines
