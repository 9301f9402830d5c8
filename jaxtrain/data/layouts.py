"""Batch layouts (`data.packing`), one registry entry each: what a row of a batch holds.

An entry carries how its rows are read from a prepared dataset (`rows` over units
[first, end), `units` of a dataset, the first held-out unit `held_out`), its synthetic
rows, its abstract batch (what an ahead-of-time compile and the planner's compile check
take), what masks the attention kernels get (`segments`) and what the data must offer (a
document index, preference pairs, a loss mask). No module tests a layout's name: the
sources, the prepared reader, the config checks and the model read these fields, and an
objective names the layouts it trains on (objectives.py `Objective.layouts`).

- concat: windows of seq_len + 1 tokens of the concatenated documents (a token array).
- documents: whole documents packed into rows, with segment ids and positions
  (data/packing.py).
- pairs: one preference pair per row, [prompt + chosen][prompt + rejected] (data/pairs.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxtrain.data import pairs as pairs_lib
from jaxtrain.data import windows
from jaxtrain.data.packing import MIN_PIECE, Packed, PackedDocuments, SyntheticDocuments


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """One `data.packing` value."""

    name: str
    doc: str  # what a row holds, as error messages say it
    # (dataset, first, end, seq_len, name, masked) -> random-access rows of the dataset's
    # units [first, end); masked: the rows carry a loss mask (a chat dataset in the run)
    rows: Callable
    units: Callable  # dataset -> the units it holds (tokens, pairs, ...)
    # (dataset, val_fraction, what) -> its first held-out unit (DataError when it cannot
    # be split; `what` names its config key)
    held_out: Callable
    # ShapeDtypeStruct [B, seq_len + 1] int32 -> the abstract batch: the array, or a Packed
    # of such arrays
    batch: Callable
    synthetic: type | None = None  # (vocab, seq_len, seed, size=) -> rows; None: none
    segments: bool = False  # the attention kernels get document masks (segment ids)
    documents: bool = False  # needs a source with a document index (SOURCES `documents`)
    pairs: bool = False  # reads datasets of preference pairs (prepare --preference), only
    loss_mask: bool = False  # keeps a chat dataset's loss mask
    min_seq_len: int = 1  # model.seq_len must be at least this
    # Recorded in a run's data fingerprint (data/record.py): False for concat, whose runs
    # were recorded before there were layouts, so that they resume.
    recorded: bool = True


def _documents(dataset, first, end, seq_len, name, masked):
    return PackedDocuments(dataset, first, end, seq_len, name, masked=masked)


def _windows(dataset, first, end, seq_len, name, masked):
    del masked  # refused before (loss_mask False)
    return windows.PreparedWindows(dataset, first, end, seq_len, name)


def _pairs(dataset, first, end, seq_len, name, masked):
    del masked  # a pairs dataset is always masked on its replies
    return pairs_lib.PairRows(dataset, first, end, seq_len, name)


def _tokens(dataset) -> int:
    return dataset.num_tokens


LAYOUTS: dict[str, BatchLayout] = {layout.name: layout for layout in (
    BatchLayout("concat", "windows of the concatenated documents", _windows, _tokens,
                windows.document_cut, lambda rows: rows, synthetic=windows.SyntheticWindows,
                recorded=False),
    BatchLayout("documents", "whole documents packed into rows", _documents, _tokens,
                windows.document_cut, lambda rows: Packed(rows, rows, rows),
                synthetic=SyntheticDocuments, segments=True, documents=True, loss_mask=True,
                min_seq_len=MIN_PIECE),
    BatchLayout("pairs", "rows of preference pairs (a dataset made by jaxtrain prepare "
                "--preference)", _pairs, pairs_lib.pair_count, pairs_lib.held_out_pair,
                lambda rows: Packed(rows, rows, rows, rows), segments=True, documents=True,
                pairs=True, loss_mask=True),
)}


def named(choose: Callable[[BatchLayout], bool]) -> str:
    """"data.packing='a' or 'b'": the layouts `choose` picks, for a message."""
    return "data.packing=" + " or ".join(repr(n) for n, lay in LAYOUTS.items() if choose(lay))
