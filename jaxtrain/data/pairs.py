"""data.packing='pairs': one preference pair per row, for the objectives on pairs (dpo, simpo).

A dataset made by `jaxtrain prepare --preference` (manifest `"pairs": true`) stores pair k
as documents 2k (the prompt and the chosen reply) and 2k + 1 (the prompt and the rejected
reply), with a loss mask on each reply (and the end-of-turn token its template writes).
Row k is pair k:

    tokens     [chosen][rejected][0 ...]
    segments   1 on the chosen document, 2 on the rejected one, 0 in padding
    positions  restarting at 0 in each document
    mask       the dataset's loss mask (the replies)

so each reply is seen under its own prompt alone (the segments are a document mask), and
the objective sums each segment's counted targets (objectives.py). A pair longer than a
row (model.seq_len + 1 slots) is refused when the rows are opened, before anything
compiles (prepare with --max-length model.seq_len+1 skips and counts such pairs).
"""

from __future__ import annotations

import numpy as np

from jaxtrain.data.packing import Packed, row_arrays
from jaxtrain.errors import DataError


class PairRows:
    """Random-access rows of pairs [first, end) of a pairs dataset."""

    def __init__(self, dataset, first: int, end: int, seq_len: int, name: str):
        if end <= first:
            raise DataError(f"{name} holds no preference pair")
        self.dataset, self.capacity = dataset, seq_len + 1
        lo = dataset.document(2 * first)[0]
        hi = dataset.document(2 * end)[0] if 2 * end < dataset.num_documents \
            else dataset.num_tokens
        self.starts, self.lengths = dataset.documents_in(lo, hi)
        if len(self.starts) != 2 * (end - first):
            raise DataError(f"{name}: its documents do not form pairs; prepare it again "
                            "with --preference")
        pair_P = self.lengths[0::2] + self.lengths[1::2]
        if pair_P.max() > self.capacity:
            k = int(np.argmax(pair_P))
            raise DataError(f"{name}: pair {first + k} holds {int(pair_P[k])} tokens, more "
                            f"than a row of model.seq_len+1={self.capacity}; raise "
                            f"model.seq_len, or prepare with --max-length {self.capacity} "
                            "(longer pairs are skipped and counted)")

    def __len__(self) -> int:
        return len(self.starts) // 2

    def __getitem__(self, index: int) -> Packed:
        k = 2 * (index % len(self))
        parts = [(int(self.starts[k + j]), int(self.lengths[k + j])) for j in (0, 1)]
        return row_arrays(parts, self.dataset.read, self.capacity, self.dataset.read_mask)


def pair_count(dataset) -> int:
    """The pairs of a pairs dataset: its units (data/layouts.py)."""
    return dataset.num_documents // 2


def held_out_pair(dataset, val_fraction: float, what: str) -> int:
    """The first held-out pair of a dataset split into training and validation pairs;
    DataError (one line) with fewer than 2 pairs."""
    pairs = pair_count(dataset)
    if pairs < 2:
        raise DataError(f"{what}={dataset.path} holds {pairs} preference pair(s): at least 2 "
                        "are needed (one to train on, one held out), or give data.val_path")
    return split_pairs(pairs, val_fraction)


def split_pairs(num_pairs: int, val_fraction: float) -> int:
    """The first held-out pair: the tail of about val_fraction of the pairs, at least one
    pair on each side."""
    return min(max(1, round(num_pairs * (1.0 - val_fraction))), num_pairs - 1)
