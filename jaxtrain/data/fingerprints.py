"""Fingerprints of data sources: what a run trained on, as {item: {fingerprint, about}}.

`fingerprint` is compared on resume (jaxtrain.data.record); `about` is what the one-line
refusal shows. Content decides a fingerprint, never where the data lies.
"""

from __future__ import annotations

import hashlib
import pathlib
import platform

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


def token_file(path: pathlib.Path) -> dict:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
            how = "sha256"
        else:
            for k in range(SAMPLE_BLOCKS):
                f.seek((size - SAMPLE_BYTES) * k // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BYTES))
            how = "sampled sha256"
    digest = h.hexdigest()
    return item(digest, f"{path} ({size:,} bytes, {how} {digest[:12]})")


def value(v) -> dict:
    """A config value that decides the data (a split fraction, mixture weights)."""
    return item(repr(v), repr(v))
