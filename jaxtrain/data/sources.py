"""Token sources: the built-in stdlib corpus, nanoGPT .bin files, synthetic tokens.

Each source is random access: item i is the i-th window of seq_len + 1 tokens (inputs and
their next-token targets), so any step's batch can be read without reading the ones before.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig

import numpy as np


class DataError(ValueError):
    """A data source that cannot be read; the message is one line naming the source."""


class TokenWindows:
    """Non-overlapping windows of seq_len + 1 tokens over a flat token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str):
        if len(tokens) < seq_len + 1:
            raise DataError(f"{name} holds {len(tokens)} tokens, fewer than one sequence "
                            f"of model.seq_len+1={seq_len + 1}")
        self.tokens, self.seq_len = tokens, seq_len
        self.size = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        start = (index % self.size) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)


class SyntheticWindows:
    """Uniform random tokens, a fixed function of (seed, index); for benchmarks."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, size: int = 1 << 30):
        self.vocab_size, self.seq_len, self.seed, self.size = vocab_size, seq_len, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, index))
        return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)


def stdlib_corpus() -> np.ndarray:
    """The bytes of this Python's own standard library sources, in a fixed file order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise DataError(f"data.source='stdlib' found no .py files under {root}")
    return np.frombuffer(b"".join(p.read_bytes() for p in files), dtype=np.uint8)


def _memmap(path: pathlib.Path, dtype: str) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"data.path: token file {path} does not exist")
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"data.path: token file {path} is empty")
    if size % itemsize:
        raise DataError(f"data.path: {path} has {size} bytes, not a whole number of "
                        f"{dtype} tokens; is data.dtype right?")
    return np.memmap(path, dtype=dtype, mode="r")


def _check_vocab(tokens: np.ndarray, vocab_size: int, name: str) -> None:
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(f"{name} holds token id {top}, outside model.vocab_size={vocab_size}")


def token_splits(data_cfg, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token arrays for the stdlib or bin sources."""
    if data_cfg.source == "stdlib":
        tokens = stdlib_corpus()
        name = "the stdlib corpus"
    else:
        path = pathlib.Path(os.path.expanduser(data_cfg.path))
        if path.is_dir():
            train = _memmap(path / "train.bin", data_cfg.dtype)
            val = _memmap(path / "val.bin", data_cfg.dtype)
            _check_vocab(train, vocab_size, str(path / "train.bin"))
            _check_vocab(val, vocab_size, str(path / "val.bin"))
            return train, val
        tokens = _memmap(path, data_cfg.dtype)
        name = str(path)
        _check_vocab(tokens, vocab_size, name)
    cut = int(len(tokens) * (1.0 - data_cfg.val_fraction))
    return tokens[:cut], tokens[cut:]
