"""Rows of data.packing='concat': windows of seq_len + 1 tokens of the concatenated
documents, from a prepared dataset or synthetic (the layout's readers, data/layouts.py)."""

from __future__ import annotations

import numpy as np

from jaxtrain.errors import DataError


class PreparedWindows:
    """Non-overlapping windows of seq_len + 1 tokens over tokens [start, end) of a dataset
    (documents concatenated: data.packing='concat')."""

    def __init__(self, dataset, start: int, end: int, seq_len: int, name: str):
        if end - start < seq_len + 1:
            raise DataError(f"{name} holds {end - start} tokens, fewer than one sequence of "
                            f"model.seq_len+1={seq_len + 1}")
        self.dataset, self.start, self.seq_len = dataset, start, seq_len
        self.size = (end - start - 1) // seq_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        offset = self.start + (index % self.size) * self.seq_len
        return self.dataset.read(offset, self.seq_len + 1)


class SyntheticWindows:
    """Uniform random tokens, a fixed function of (seed, index); for benchmarks."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, size: int = 1 << 30):
        self.vocab_size, self.seq_len, self.seed, self.size = vocab_size, seq_len, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, index))
        return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)


def document_cut(dataset, val_fraction: float, what: str) -> int:
    """The first held-out token of a dataset of token rows: at the document boundary
    nearest the tail of about val_fraction of its tokens (no document on both sides), or,
    for a single document, at that fraction."""
    del what  # every split of tokens has one; too few tokens are refused by its rows
    if dataset.num_documents >= 2:
        return dataset.document(dataset.split_point(val_fraction))[0]
    return int(dataset.num_tokens * (1.0 - val_fraction))
