"""The on-disk form of a prepared dataset, and random access to it.

    DIR/manifest.json        written last: a directory without it is not a dataset
    DIR/tokenizer/           the tokenizer that made the ids (jaxtrain.data.tokenizers)
    DIR/tokens-00000.bin     token ids, flat: uint8 (vocab <= 256), uint16 (<= 65536) or uint32,
                             little-endian
    DIR/docs-00000.npy       int64 [documents, 2]: start (in the shard) and length of each
    DIR/shard-00000.json     what made the shard (units of input, counts, sha256)
    DIR/mask-00000.bin       chat datasets (prepare --chat) only: uint8 a token, 1 where the
                             token is a target the loss counts (its shard entry's `mask`)

A merged dataset (prepare --shard i/N on many machines, then --merge) lists shards in its
part directories (`part-00000-of-00004/tokens-00000.bin`). Shards are memory-mapped, so a
dataset larger than RAM is normal: only the pages a batch touches are read. DIR may be a
gs:// or s3:// prefix: then the token shards are read by range requests into a bounded
block cache (jaxtrain.data.remote_file), the small files (manifest, document indexes) whole,
and the tokenizer is copied to local scratch for the libraries that read it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import shutil
import tempfile
import threading

import numpy as np

from jaxtrain import storage
from jaxtrain.data import fingerprints, remote_file, shard_check
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.errors import DataError

FORMAT = "jaxtrain-prepared-v1"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
PARTIAL_SUFFIX = ".partial"
FAILED = "failed.json"  # in DIR.partial: the error that stopped its prepare
# Opening a shard on first use: grain's reader threads may ask for it at once, and on object
# storage each opening is a request (a size check, or a document index read whole).
_OPENING = threading.Lock()


def shard_names(index: int) -> tuple[str, str, str]:
    return f"tokens-{index:05d}.bin", f"docs-{index:05d}.npy", f"shard-{index:05d}.json"


def mask_name(index: int) -> str:
    """The loss mask of shard `index` (chat datasets): uint8 0/1 a token, 1 where the token
    is a target the loss counts."""
    return f"mask-{index:05d}.bin"


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
    if any("mask" in s["stream"] for s in shards):  # a chat dataset: its mask is data too
        content["mask"] = fingerprints.join_stream_hashes(
            [(s["stream"]["mask"], s["num_tokens"]) for s in shards])
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


def _read_manifest(path, what: str) -> bytes:
    """DIR/manifest.json's bytes; DataError (one line) when DIR is no dataset, ConfigError
    for an object store's credentials, bucket or permission."""
    manifest = path / MANIFEST
    if storage.on_disk(path):
        blob = manifest.read_bytes() if manifest.is_file() else None
    else:
        blob = remote_file.read_whole(manifest, what, missing_ok=True)
    if blob is None:
        raise DataError(f"{what}={path} is not a prepared dataset (no {MANIFEST})"
                        f"{_unfinished(path)}")
    return blob


def _local_copy(remote, version: str) -> pathlib.Path:
    """A copy of a small remote directory on this host's scratch disk, named by `version`
    (a content hash: a copy is never stale) and made once: downloaded beside it, then
    renamed into place, so that processes sharing the host never read a half-made one."""
    target = storage.scratch_dir(remote, "copy") / version
    if not target.is_dir():
        partial = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
        storage.download_tree(remote, partial)
        try:
            os.rename(partial, target)
        except OSError:  # another process of this host made it first
            shutil.rmtree(partial, ignore_errors=True)
    return target


class PreparedDataset:
    """Random access to the tokens and documents of a complete prepared dataset.

    `cache`: the block cache for a dataset on object storage (default: the process's)."""

    def __init__(self, path, what: str = "data.path",
                 cache: remote_file.BlockCache | None = None):
        self.path = storage.as_path(path, what)
        self.remote = not storage.on_disk(self.path)  # read by requests, not memory-mapped
        self.cache = cache
        blob = _read_manifest(self.path, what)
        try:
            self.manifest = json.loads(blob)
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
        self._files = self._contained_files(path, what)
        self._tokens: list = [None] * len(self.shards)
        self._masks: list = [None] * len(self.shards)
        self._index: list = [None] * len(self.shards)
        self._local_tokenizer: pathlib.Path | None = None

    def _contained_files(self, path, what: str) -> list[dict]:
        """Each shard's {key: path} of its tokens, index and mask, every name checked to lie
        inside the dataset before anything is read (a manifest is someone else's input)."""
        files = []
        for k, shard in enumerate(self.shards):
            files.append({key: storage.contained(
                self.path, shard[key], f"{what}={path}: {MANIFEST} (shard {k}'s {key!r})")
                for key in ("tokens", "index", "mask") if shard.get(key) is not None})
        return files

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
        """DIR/tokenizer, or for a dataset on object storage its copy on local scratch (the
        tokenizer libraries read local files), made on first use."""
        if not self.remote:
            return self.path / TOKENIZER_DIR
        if self._local_tokenizer is None:
            self._local_tokenizer = _local_copy(self.path / TOKENIZER_DIR,
                                                self.tokenizer_meta["fingerprint"][:16])
        return self._local_tokenizer

    def tokenizer(self) -> tokenizers_lib.Tokenizer:
        return tokenizers_lib.load_tokenizer(self.tokenizer_dir, what=self.what)

    @property
    def masked(self) -> bool:
        """Whether the dataset has a loss mask (prepare --chat): read_mask."""
        return any(s.get("mask") for s in self.shards)

    @property
    def pairs(self) -> bool:
        """Whether the dataset holds preference pairs (prepare --preference: documents 2k
        and 2k + 1 are pair k's chosen and rejected; data/pairs.py)."""
        return bool(self.manifest.get("pairs"))

    def _shard_tokens(self, k: int, key: str = "tokens"):
        """Shard k's tokens (or its mask, key "mask"): a memmap on disk, a RemoteArray on
        object storage (both read only what is sliced and converted)."""
        arrays = self._tokens if key == "tokens" else self._masks
        if arrays[k] is None:
            with _OPENING:
                if arrays[k] is None:
                    arrays[k] = self._open_tokens(k, key)
        return arrays[k]

    def _open_tokens(self, k: int, key: str = "tokens"):
        dtype = self.dtype if key == "tokens" else np.dtype(np.uint8)
        path = self._files[k][key]
        expected = self.shards[k]["num_tokens"] * dtype.itemsize
        if self.remote:
            info = remote_file.object_info(path, self.what)
            size = None if info is None else int(info["size"])
        else:
            info = path.stat() if path.is_file() else None
            size = None if info is None else info.st_size
        if size != expected:
            raise DataError(f"{self.what}={self.path}: shard {path.name} is missing or not "
                            f"{expected} bytes; the dataset is damaged: prepare it again")
        if key == "tokens" and self.shards[k].get("sha256"):
            shard_check.verify(path, size, info, self.shards[k]["sha256"],
                               f"{self.what}={self.path}")
        if self.remote:
            return remote_file.RemoteArray(path, dtype, self.cache, size, self.what)
        return np.memmap(path, dtype=dtype, mode="r")

    def _shard_index(self, k: int) -> np.ndarray:
        """Shard k's document index ([documents, 2]): memory-mapped on disk, read whole from
        object storage (16 bytes a document; the binary searches need all of it)."""
        if self._index[k] is None:
            with _OPENING:
                if self._index[k] is None:
                    path = self._files[k]["index"]
                    self._index[k] = (
                        np.load(io.BytesIO(remote_file.read_whole(path, self.what)))
                        if self.remote else np.load(path, mmap_mode="r"))
        return self._index[k]

    def read(self, start: int, length: int, key: str = "tokens") -> np.ndarray:
        """Tokens [start, start + length) of the concatenated shards, as int32 (key "mask":
        their loss mask, read_mask)."""
        out = np.empty(length, dtype=np.int32)
        done = 0
        while done < length:
            position = start + done
            k = int(np.searchsorted(self.shard_starts, position, side="right")) - 1
            local = position - int(self.shard_starts[k])
            take = min(length - done, int(self.shard_starts[k + 1]) - position)
            out[done:done + take] = np.asarray(self._shard_tokens(k, key)[local:local + take])
            done += take
        return out

    def read_mask(self, start: int, length: int) -> np.ndarray:
        """The loss mask of tokens [start, start + length), int32 0/1 (1: a target the loss
        counts); all ones for a dataset without one."""
        if not self.masked:
            return np.ones(length, dtype=np.int32)
        return self.read(start, length, "mask")

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
