"""data.packing='documents': documents packed into rows, with segment ids and positions.

A row has seq_len + 1 slots (inputs are slots 0..L-1, targets 1..L, as for a window of the
concatenated stream). It holds whole documents, one after another, then padding:

    tokens     the documents' token ids; 0 in padding
    segments   the document of each slot: 1, 2, ... in row order; 0 for padding
    positions  each slot's position in its document, restarting at 0; 0 for padding

The model masks attention to one document (models/attention/) and takes the positions
for RoPE or learned position embeddings. A target counts when the slot before it is of the
same document (train/step.py): a document of n tokens trains its n - 1 next-token
predictions, as if it were run alone; the first token of each document (nothing to predict
it from) and padding count for nothing.

**Pieces.** A document longer than a row is cut into pieces of at most L + 1 tokens, each
starting where the last one's predictions ended (piece j holds tokens [jL, jL + L + 1)): the
one token they share is the last target of one piece and the first input of the next, so
every prediction of the document is trained exactly once. A piece is a document of its own
to the model: its positions restart at 0 and it sees nothing of the pieces before it.
Documents of fewer than 2 tokens have nothing to train and are skipped.

**Windows, best fit.** The dataset's tokens are cut into windows of `window_tokens(L)`
tokens in their order on disk; the pieces that start in a window are packed into that
window's `ROWS_PER_WINDOW` rows by best fit decreasing (longest first, each into the row
whose free space fits it most tightly). Whatever best fit leaves over is split, sharing one
token at each cut as above, into the rows' remaining free space in row order. The window's
size guarantees that everything fits (the bound in `window_tokens`); the padding this leaves
is measured in docs/benchmarks.md. The last window holds the split's tail, usually far less
than a window: only its rows that hold something are rows (best fit opens a row only when
no open one fits, so they are its first ones), so a small split (30 conversations in one
window) is not 64 rows mostly of padding. Row i is row i % 64 of window i // 64: a pure
function of the dataset and L, computed from the document index alone when a row is read
(the last window's count at start-up, from its plan), so the grain pipeline shuffles rows
with the run's seed and reads any step's rows without reading the ones before (exact
resume, each process reading only its own rows), as for concat. Rows hold neighbouring
documents, as windows of the concatenated stream do; the shuffle is over rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from jaxtrain.errors import DataError

ROWS_PER_WINDOW = 64
MIN_PIECE = 2  # tokens: one prediction


class Packed(NamedTuple):
    """Packed rows (or a batch of them): int32 arrays [..., seq_len + 1] each. A pytree, so
    grain batches it and jax shards it like a plain token array. `mask` (chat data, prepare
    --chat): 1 where the slot's token is a target the loss counts; None (no leaf) when the
    run's data has no loss mask, so that such a run is what it was before masks."""

    tokens: np.ndarray
    segments: np.ndarray
    positions: np.ndarray
    mask: np.ndarray | None = None


def counted_targets(segments_xT, mask_xT=None):
    """Bool [..., T-1]: the targets of packed rows that count: the slot before is of the same
    document, it is no padding, and the loss mask (if any) marks the target. numpy or jax
    arrays alike."""
    counted = (segments_xT[..., 1:] == segments_xT[..., :-1]) & (segments_xT[..., 1:] != 0)
    return counted if mask_xT is None else counted & (mask_xT[..., 1:] != 0)


def batch_targets(batch):
    """counted_targets of a Packed row or batch, its loss mask included."""
    return counted_targets(batch.segments, batch.mask)


def window_tokens(seq_len: int, rows: int = ROWS_PER_WINDOW) -> int:
    """Dataset tokens per window such that its pieces always fit its rows.

    The pieces starting in S tokens hold at most S + L + S/L + 1 tokens (S + L distinct ones,
    plus one shared token per continuation piece); the split of best fit's leftovers wastes
    at most 2 slots per row (a free slot too small for a piece, and the shared token of a
    cut). So S(1 + 1/L) + L + 1 + 2R <= R(L + 1) suffices."""
    length = seq_len
    return max(1, (rows * (length - 1) - length - 1) * length // (length + 1))


def pieces(starts: np.ndarray, lengths: np.ndarray, seq_len: int, lo: int, hi: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """(first token, length) of the pieces (module docstring) of the documents (their first
    tokens and lengths) that start in tokens [lo, hi), in order."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    count_D = np.where(lengths >= MIN_PIECE, (lengths - MIN_PIECE) // seq_len + 1, 0)
    first_D = np.maximum(0, -((starts - lo) // seq_len))  # ceil((lo - start) / L)
    last_D = np.minimum(count_D, -((starts - hi) // seq_len))
    take_D = np.maximum(0, last_D - first_D)
    doc_P = np.repeat(np.arange(len(starts)), take_D)
    ahead_P = np.arange(len(doc_P)) - np.repeat(np.cumsum(take_D) - take_D, take_D)
    start_P = starts[doc_P] + (first_D[doc_P] + ahead_P) * seq_len
    length_P = np.minimum(seq_len + 1, starts[doc_P] + lengths[doc_P] - start_P)
    return start_P, length_P


def best_fit(lengths: np.ndarray, rows: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(row of each piece, -1 where none fits; free slots left in each row): best fit
    decreasing, ties to the earlier piece and the lower row."""
    free = np.full(rows, capacity, np.int64)
    row_of = np.full(len(lengths), -1, np.int64)
    for p in np.argsort(-np.asarray(lengths), kind="stable"):
        size = lengths[p]
        tight = np.where(free >= size, free, capacity + 1)
        r = int(np.argmin(tight))
        if tight[r] <= capacity:
            row_of[p] = r
            free[r] -= size
    return row_of, free


def plan_rows(start_P: np.ndarray, length_P: np.ndarray, rows: int, capacity: int
              ) -> list[list[tuple[int, int]]]:
    """Each row's parts (first token, length), in slot order: its best-fit pieces in dataset
    order, then its share of the leftovers."""
    row_of, free = best_fit(length_P, rows, capacity)
    parts: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    for p in np.flatnonzero(row_of >= 0):
        parts[row_of[p]].append((int(start_P[p]), int(length_P[p])))
    row = 0
    for p in np.flatnonzero(row_of < 0):
        start, left = int(start_P[p]), int(length_P[p])
        while left:
            while row < rows and free[row] < MIN_PIECE:
                row += 1
            if row == rows:
                raise AssertionError("packing: a window's pieces exceed its rows; "
                                     "window_tokens is wrong")
            take = min(left, int(free[row]))
            parts[row].append((start, take))
            free[row] -= take
            # A cut shares its token: the next part starts with this part's last token.
            start, left = (start + take - 1, left - take + 1) if take < left else (start, 0)
    return parts


def row_arrays(parts, read, capacity: int, read_mask=None) -> Packed:
    """One row from its parts; read(start, length) -> the tokens, read_mask(start, length)
    -> their loss mask (None: the row has no mask)."""
    tokens = np.zeros(capacity, np.int32)
    segments = np.zeros(capacity, np.int32)
    positions = np.zeros(capacity, np.int32)
    mask = None if read_mask is None else np.zeros(capacity, np.int32)
    at = 0
    for k, (start, length) in enumerate(parts, start=1):
        tokens[at:at + length] = read(start, length)
        segments[at:at + length] = k
        positions[at:at + length] = np.arange(length)
        if mask is not None:
            mask[at:at + length] = read_mask(start, length)
        at += length
    return Packed(tokens, segments, positions, mask)


class PackedDocuments:
    """Random-access packed rows of the documents in tokens [start, end) of a prepared
    dataset (a split: its ends are document boundaries, or cut documents short). `masked`:
    rows carry the dataset's loss mask (read_mask: all ones for one without, so that a
    mixture's unmasked datasets count every target)."""

    def __init__(self, dataset, start: int, end: int, seq_len: int, name: str,
                 rows: int = ROWS_PER_WINDOW, masked: bool = False):
        self.dataset, self.start, self.end = dataset, start, end
        self.masked = masked
        self.seq_len, self.rows, self.capacity = seq_len, rows, seq_len + 1
        self.span = window_tokens(seq_len, rows)
        self.windows = -(-(end - start) // self.span)
        if end - start < MIN_PIECE:
            raise DataError(f"{name} holds {end - start} tokens: no document to pack")
        self.name = name
        # Rows are read in shuffled order, so a window is rarely met twice in a row; the
        # cache serves validation, which reads rows in order.
        self._plan = functools.lru_cache(maxsize=16)(self._plan_window)
        self._last_rows = [r for r, parts in enumerate(self._plan(self.windows - 1)) if parts]
        if not len(self):
            raise DataError(f"{name} holds no document of {MIN_PIECE} tokens or more to pack")

    def __len__(self) -> int:
        return (self.windows - 1) * self.rows + len(self._last_rows)

    def _plan_window(self, w: int) -> list[list[tuple[int, int]]]:
        lo = self.start + w * self.span
        hi = min(lo + self.span, self.end)
        starts, lengths = self.dataset.documents_in(lo, hi)
        ends = np.minimum(starts + lengths, self.end)
        starts = np.maximum(starts, self.start)
        start_P, length_P = pieces(starts, ends - starts, self.seq_len, lo, hi)
        return plan_rows(start_P, length_P, self.rows, self.capacity)

    def _rows_of(self, w: int) -> list[int]:
        return self._last_rows if w == self.windows - 1 else range(self.rows)

    def __getitem__(self, index: int) -> Packed:
        w, r = divmod(index % len(self), self.rows)
        return row_arrays(self._plan(w)[self._rows_of(w)[r]], self.dataset.read,
                          self.capacity, self.dataset.read_mask if self.masked else None)

    def cut_documents(self) -> tuple[int, int]:
        """(how many documents of a chat dataset are longer than a row, the longest's
        tokens): they are cut into pieces, and the pieces after the first lose their prompt.
        (0, 0) for a dataset without a loss mask, whose long documents are meant to be cut."""
        if not getattr(self.dataset, "masked", False):
            return 0, 0
        starts, lengths = self.dataset.documents_in(self.start, self.end)
        lengths = np.minimum(starts + lengths, self.end) - np.maximum(starts, self.start)
        long = lengths[lengths > self.capacity]
        return len(long), int(long.max()) if len(long) else 0

    def padding(self, sample: int = 64) -> float:
        """The fraction of slots left as padding, over the first `sample` windows."""
        used = total = 0
        for w in range(min(sample, self.windows)):
            plan = self._plan(w)
            used += sum(n for parts in plan for _, n in parts)
            total += len(self._rows_of(w)) * self.capacity
        return 1.0 - used / max(total, 1)


class SyntheticDocuments:
    """Packed rows of uniform random tokens in documents of random lengths (mean L/4, a
    little padding at the row's end): a function of (seed, index), for benchmarks with the
    shapes and masks of real packed data."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, size: int = 1 << 30):
        self.vocab_size, self.seq_len, self.seed, self.size = vocab_size, seq_len, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Packed:
        rng = np.random.default_rng((self.seed, index))
        capacity = self.seq_len + 1
        used = int(rng.integers(capacity * 19 // 20, capacity + 1))
        cuts = [0]
        while cuts[-1] < used:
            step = max(MIN_PIECE, int(rng.exponential(max(self.seq_len / 4, MIN_PIECE))))
            cuts.append(min(used, cuts[-1] + step))
        if len(cuts) > 2 and cuts[-1] - cuts[-2] < MIN_PIECE:
            cuts.pop(-2)  # every part holds a prediction
        tokens = np.zeros(capacity, np.int32)
        tokens[:used] = rng.integers(0, self.vocab_size, used, dtype=np.int32)
        segments = np.zeros(capacity, np.int32)
        positions = np.zeros(capacity, np.int32)
        for k, (a, b) in enumerate(zip(cuts, cuts[1:]), start=1):
            segments[a:b] = k
            positions[a:b] = np.arange(b - a)
        return Packed(tokens, segments, positions)
