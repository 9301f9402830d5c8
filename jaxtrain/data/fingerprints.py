"""Fingerprints of data sources: what a run trained on, as {item: {fingerprint, about}}.

`fingerprint` is compared on resume (jaxtrain.data.record); `about` is what the one-line
refusal shows. Content decides a fingerprint, never where the data lies.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import platform

import numpy as np

from jaxtrain import storage
from jaxtrain.data import remote_file

# Files up to this size are hashed whole; bigger ones by 64 evenly spaced 1 MiB blocks (and
# their size), so that starting or resuming a run does not reread terabytes.
FULL_HASH_BYTES = 1 << 28
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 1 << 20


def item(fingerprint: str, about: str) -> dict:
    return {"fingerprint": fingerprint, "about": about}


def stdlib_corpus(files: list[pathlib.Path]) -> dict:
    """The built-in corpus: sha256 of its bytes, with the Python that supplied them."""
    h, size = hashlib.sha256(), 0
    for path in files:
        data = path.read_bytes()
        h.update(data)
        size += len(data)
    digest = h.hexdigest()
    return item(digest, f"the stdlib corpus of Python {platform.python_version()} "
                        f"({len(files):,} files, {size:,} bytes, sha256 {digest[:12]})")


def _spans(size: int) -> tuple[list[tuple[int, int]], str]:
    """The byte ranges a token file's fingerprint hashes: all of it in 16 MiB reads, or
    SAMPLE_BLOCKS evenly spaced blocks of a big one."""
    if size <= FULL_HASH_BYTES:
        return [(s, min(s + (1 << 24), size)) for s in range(0, size, 1 << 24)], "sha256"
    starts = [(size - SAMPLE_BYTES) * k // (SAMPLE_BLOCKS - 1) for k in range(SAMPLE_BLOCKS)]
    return [(s, s + SAMPLE_BYTES) for s in starts], "sampled sha256"


def _file_blocks(path, spans):
    with open(path, "rb") as f:
        for start, end in spans:
            f.seek(start)
            yield f.read(end - start)


def token_file(path) -> dict:
    """A .bin file's fingerprint: the same for its bytes on disk and on object storage (read
    there by range requests, jaxtrain.data.remote_file), so data may move to a bucket."""
    remote = not storage.on_disk(path)
    size = remote_file.object_size(path) if remote else path.stat().st_size
    spans, how = _spans(size)
    blocks = ((remote_file.read_range(path, start, end) for start, end in spans) if remote
              else _file_blocks(path, spans))
    h = hashlib.sha256(str(size).encode())
    for block in blocks:
        h.update(block)
    digest = h.hexdigest()
    return item(digest, f"{path} ({size:,} bytes, {how} {digest[:12]})")


# --- a hash of a token stream that composes over concatenation ------------------------------
#
# A prepared dataset's fingerprint must not depend on how its stream was cut (shards,
# units, the parts of a multi-machine prepare), and a merge of parts must find it without
# rereading the parts' tokens. sha256 cannot be joined from pieces; a polynomial hash can:
# H(s) = sum_j s_j r^(n-1-j) mod p, so H(a + b) = H(a) r^len(b) + H(b). Four primes near
# 2^31 keep the arithmetic inside uint64 (values < 2^32), so numpy computes it at ~10-20 ns a
# token (under 1% of tokenizing); accidental collisions are ~2^-120 likely. It fingerprints
# content; it is no defence against a forger (the shards' sha256 still guard their bytes).

_PRIMES = (2147483647, 2147483629, 2147483587, 2147483579)
_BASES = (1103515245, 1664525, 22695477, 134775813)
# Weights split in 16-bit halves: value (< 2^32) x half (< 2^16) < 2^48, and a chunk of 2^15
# such products sums below 2^63, so a chunk is two integer dot products and no vector modulo.
_CHUNK = 1 << 15
_LOW32 = np.uint64(0xFFFFFFFF)


@functools.cache
def _weights() -> np.ndarray:
    """[8, _CHUNK] uint64: the high, then the low 16 bits of r^(_CHUNK-1-k) mod p for each
    (r, p) (a chunk of length L takes [:, -L:]); by doubling, r^(L..2L-1) = r^(0..L-1) r^L,
    in a millisecond rather than a Python loop's 0.1 s in every worker."""
    primes = np.array(_PRIMES, dtype=np.uint64)[:, None]
    powers = np.ones((len(_PRIMES), 1), dtype=np.uint64)
    while powers.shape[1] < _CHUNK:
        step = np.array([pow(r, powers.shape[1], p) for r, p in zip(_BASES, _PRIMES)],
                        dtype=np.uint64)[:, None]
        powers = np.concatenate([powers, powers * step % primes], axis=1)
    weights = powers[:, ::-1]
    return np.concatenate([weights >> np.uint64(16), weights & np.uint64(0xFFFF)])


def stream_hash(values: np.ndarray) -> str:
    """The composable hash of a sequence of integers below 2^32, as 32 hex digits."""
    values = np.asarray(values).astype(np.uint64, copy=False) & _LOW32
    weights, m = _weights(), len(_PRIMES)
    h = [0] * m
    for start in range(0, len(values), _CHUNK):
        chunk = values[start:start + _CHUNK]
        n = len(chunk)
        sums = [int(x) for x in weights[:, _CHUNK - n:] @ chunk]
        h = [(a * pow(r, n, p) + (sums[k] % p << 16) + sums[m + k]) % p
             for k, (a, r, p) in enumerate(zip(h, _BASES, _PRIMES))]
    return "".join(f"{x:08x}" for x in h)


def join_stream_hashes(pieces: list[tuple[str, int]]) -> str:
    """The hash of the concatenated sequences, from each piece's (hash, length), in order."""
    h = [0] * len(_PRIMES)
    for digest, length in pieces:
        values = [int(digest[8 * m:8 * m + 8], 16) for m in range(len(_PRIMES))]
        h = [(a * pow(r, length, p) + b) % p
             for a, b, r, p in zip(h, values, _BASES, _PRIMES)]
    return "".join(f"{x:08x}" for x in h)


def value(v) -> dict:
    """A config value that decides the data (a split fraction, mixture weights)."""
    return item(repr(v), repr(v))
