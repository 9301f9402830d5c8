"""A prepared shard's tokens checked against the sha256 its manifest records, where the shard
is first read: once per process per shard, and once per host for a file that has not
changed since, since hashing a multi-GB shard takes seconds (and on object storage reads it
whole). The verdict is remembered on local scratch (`storage.scratch_dir`) under a key made
of what identifies that version of the file: on disk its resolved path, size, modification
time and inode; on object storage its URL, size and the store's version of the object (ETag,
generation), so that a shard replaced since is hashed again. A store that reports no version
gets no remembered verdict: each process hashes it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import threading

from jaxtrain import storage
from jaxtrain.data import remote_file
from jaxtrain.errors import DataError

CHUNK_BYTES = 16 << 20  # read per request (object storage) or per read (disk) while hashing
_VERSION_KEYS = ("ETag", "etag", "generation", "md5Hash", "LastModified", "updated", "mtime")

_verified: set[str] = set()  # keys hashed and found right in this process
_lock = threading.Lock()


def _identity(path, size: int, info) -> tuple[str, bool]:
    """(what names this version of the file, whether it pins the content down enough to
    remember the verdict across processes)."""
    if storage.on_disk(path):
        local = pathlib.Path(path).resolve()
        return json.dumps([str(local), size, info.st_mtime_ns, info.st_ino, info.st_dev]), True
    version = [str(info.get(k)) for k in _VERSION_KEYS if info.get(k) is not None]
    return json.dumps([str(path), size, version]), bool(version)


def sha256_of(path, size: int, what: str) -> str:
    """The sha256 of the file's first `size` bytes, read CHUNK_BYTES at a time."""
    h = hashlib.sha256()
    if storage.on_disk(path):
        with open(path, "rb") as f:
            while block := f.read(CHUNK_BYTES):
                h.update(block)
        return h.hexdigest()
    for start in range(0, size, CHUNK_BYTES):
        h.update(remote_file.read_range(path, start, min(start + CHUNK_BYTES, size), what))
    return h.hexdigest()


def _marker(key: str) -> pathlib.Path | None:
    """The file whose presence says this key was hashed and found right on this host; None
    without a writable scratch directory (then each process hashes)."""
    try:
        return storage.scratch_dir("jaxtrain-shards", "verified") / key
    except OSError:
        return None


def verify(path, size: int, info, expected: str, what: str) -> None:
    """DataError (one line) when the shard at `path` (`size` bytes; `info`: its os.stat or
    the store's metadata) does not hash to `expected`; nothing when it does, or when this
    version of it has been found right before."""
    identity, lasting = _identity(path, size, info)
    key = hashlib.sha256(f"{identity}\0{expected}".encode()).hexdigest()[:32]
    with _lock:
        if key in _verified:
            return
    marker = _marker(key) if lasting else None
    if marker is None or not marker.exists():
        actual = sha256_of(path, size, what)
        if actual != expected:
            raise DataError(f"{what}: shard {path} does not match its manifest (sha256 "
                            f"{actual[:12]}, recorded {expected[:12]}); the dataset is "
                            "damaged or was changed after it was prepared: prepare it again")
        if marker is not None:
            with contextlib.suppress(OSError):  # remembered where scratch is writable
                marker.touch()
    with _lock:
        _verified.add(key)
