"""The on-disk form of a prepared dataset, and random access to it.

    DIR/manifest.json        written last: a directory without it is not a dataset
    DIR/tokenizer/           the tokenizer that made the ids (jaxtrain.data.tokenizers)
    DIR/tokens-00000.bin     token ids, flat: uint8 (vocab <= 256), uint16 (<= 65536) or uint32,
                             little-endian
    DIR/docs-00000.npy       int64 [documents, 2]: start (in the shard) and length of each
    DIR/shard-00000.json     what made the shard (units of input, counts, sha256)

A merged dataset (prepare --shard i/N on many machines, then --merge) lists shards in its
part directories (`part-00000-of-00004/tokens-00000.bin`). Shards are memory-mapped, so a
dataset larger than RAM is normal: only the pages a batch touches are read.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from jaxtrain.data import fingerprints
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.errors import DataError

FORMAT = "jaxtrain-prepared-v1"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
PARTIAL_SUFFIX = ".partial"
FAILED = "failed.json"  # in DIR.partial: the error that stopped its prepare


def shard_names(index: int) -> tuple[str, str, str]:
    return f"tokens-{index:05d}.bin", f"docs-{index:05d}.npy", f"shard-{index:05d}.json"


def dtype_for(vocab_size: int) -> str:
    if vocab_size <= 1 << 8:
        return "uint8"
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def content_fingerprint(dtype: str, tokenizer_fingerprint: str, policy: dict,
                        shards: list[dict]) -> str:
    """What the training data is: the token stream and the documents' lengths (joined from
    each shard's stream hashes, jaxtrain.data.fingerprints), with the dtype, tokenizer and
    policy; independent of where it lies and of how it was cut into shards, units, processes
    or the parts of a multi-machine prepare."""
    content = {"dtype": dtype, "tokenizer": tokenizer_fingerprint, "policy": policy,
               "num_tokens": sum(s["num_tokens"] for s in shards),
               "num_documents": sum(s["num_documents"] for s in shards),
               "tokens": fingerprints.join_stream_hashes(
                   [(s["stream"]["tokens"], s["num_tokens"]) for s in shards]),
               "lengths": fingerprints.join_stream_hashes(
                   [(s["stream"]["lengths"], s["num_documents"]) for s in shards])}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _unfinished(path: pathlib.Path) -> str:
    """Why DIR has no manifest, as far as DIR.partial tells: a prepare that failed (then the
    same command fails again), one that was interrupted, or none."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    if not partial.exists():
        return "; make one with jaxtrain prepare"
    try:
        error = json.loads((partial / FAILED).read_text())["error"]
    except (OSError, ValueError, KeyError, TypeError):
        return (f"; {partial} holds an unfinished prepare: run the same prepare command "
                "again to finish it")
    return f"; its prepare failed ({partial}): {error}; fix that, then prepare it again"


class PreparedDataset:
    """Random access to the tokens and documents of a complete prepared dataset."""

    def __init__(self, path, what: str = "data.path"):
        self.path = pathlib.Path(path).expanduser()
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise DataError(f"{what}={path} is not a prepared dataset (no {MANIFEST})"
                            f"{_unfinished(self.path)}")
        try:
            self.manifest = json.loads(manifest.read_text())
        except ValueError as e:
            raise DataError(f"{what}={path}: {MANIFEST} is unreadable ({e})") from None
        if self.manifest.get("format") != FORMAT:
            raise DataError(f"{what}={path}: {MANIFEST} has format "
                            f"{self.manifest.get('format')!r}, not {FORMAT!r}")
        self.what = what
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shards = [s for s in self.manifest["shards"] if s["num_tokens"] > 0]
        counts = [s["num_tokens"] for s in self.shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        docs = [s["num_documents"] for s in self.shards]
        self.doc_starts = np.concatenate([[0], np.cumsum(docs, dtype=np.int64)])
        self._tokens: list = [None] * len(self.shards)
        self._index: list = [None] * len(self.shards)

    @property
    def num_tokens(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def num_documents(self) -> int:
        return int(self.doc_starts[-1])

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def tokenizer_meta(self) -> dict:
        return self.manifest["tokenizer"]

    @property
    def tokenizer_dir(self) -> pathlib.Path:
        return self.path / TOKENIZER_DIR

    def tokenizer(self) -> tokenizers_lib.Tokenizer:
        return tokenizers_lib.load_tokenizer(self.tokenizer_dir, what=self.what)

    def _shard_tokens(self, k: int) -> np.ndarray:
        if self._tokens[k] is None:
            path = self.path / self.shards[k]["tokens"]
            expected = self.shards[k]["num_tokens"] * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size != expected:
                raise DataError(f"{self.what}={self.path}: shard {path.name} is missing or "
                                f"not {expected} bytes; the dataset is damaged: prepare it "
                                "again")
            self._tokens[k] = np.memmap(path, dtype=self.dtype, mode="r")
        return self._tokens[k]

    def _shard_index(self, k: int) -> np.ndarray:
        if self._index[k] is None:
            self._index[k] = np.load(self.path / self.shards[k]["index"], mmap_mode="r")
        return self._index[k]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the concatenated shards, as int32."""
        out = np.empty(length, dtype=np.int32)
        done = 0
        while done < length:
            position = start + done
            k = int(np.searchsorted(self.shard_starts, position, side="right")) - 1
            local = position - int(self.shard_starts[k])
            take = min(length - done, int(self.shard_starts[k + 1]) - position)
            out[done:done + take] = self._shard_tokens(k)[local:local + take]
            done += take
        return out

    def document(self, i: int) -> tuple[int, int]:
        """(start in the concatenated tokens, length) of document i."""
        k = int(np.searchsorted(self.doc_starts, i, side="right")) - 1
        start, length = self._shard_index(k)[i - int(self.doc_starts[k])]
        return int(self.shard_starts[k]) + int(start), int(length)

    def documents_in(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(first token, length) int64 of the documents overlapping tokens [lo, hi), in
        order, read from the index alone (binary searches, then a slice per shard)."""
        starts, lengths = [], []
        k = max(int(np.searchsorted(self.shard_starts, lo, side="right")) - 1, 0)
        while k < len(self.shards) and self.shard_starts[k] < hi:
            base, index = int(self.shard_starts[k]), self._shard_index(k)
            first = max(int(np.searchsorted(index[:, 0], lo - base, side="right")) - 1, 0)
            last = int(np.searchsorted(index[:, 0], hi - base, side="left"))
            rows = np.asarray(index[first:last], dtype=np.int64)
            keep = rows[:, 0] + rows[:, 1] + base > lo
            starts.append(rows[keep, 0] + base)
            lengths.append(rows[keep, 1])
            k += 1
        if not starts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(starts), np.concatenate(lengths)

    def split_point(self, val_fraction: float) -> int:
        """The first document of a held-out tail holding about val_fraction of the tokens."""
        target = self.num_tokens * (1.0 - val_fraction)
        low, high = 1, self.num_documents - 1  # both sides keep at least one document
        while low < high:
            mid = (low + high) // 2
            if self.document(mid)[0] < target:
                low = mid + 1
            else:
                high = mid
        return low
