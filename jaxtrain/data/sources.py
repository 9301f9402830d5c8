"""Token sources, one registry entry per `data.source`: the built-in stdlib corpus, nanoGPT
.bin files, synthetic tokens, prepared datasets (jaxtrain.data.prepared_source).

Each source is random access: item i is the i-th window of seq_len + 1 tokens (inputs and
their next-token targets), so any step's batch can be read without reading the ones before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxtrain import storage
from jaxtrain.data import fingerprints, prepared_source, prompt_set, remote_file, tokenizers
from jaxtrain.data.layouts import LAYOUTS
from jaxtrain.data.stdlib import stdlib_files
from jaxtrain.data.windows import SyntheticWindows  # noqa: F401 (its old home)
from jaxtrain.errors import DataError, fail


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


def stdlib_corpus() -> np.ndarray:
    """The bytes of this Python's own standard library sources, in a fixed file order."""
    return np.frombuffer(b"".join(p.read_bytes() for p in stdlib_files()), dtype=np.uint8)


def _memmap(path, dtype: str, c):
    """The tokens of a .bin file: memory-mapped on disk; on object storage a RemoteArray
    (range requests through the block cache as data.cache_mb and data.block_kb size it)."""
    remote = not storage.on_disk(path)
    if remote:
        size = remote_file.object_size(path, "data.path")
    else:
        size = path.stat().st_size if path.is_file() else None
    if size is None:
        raise DataError(f"data.path: token file {path} does not exist")
    itemsize = np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"data.path: token file {path} is empty")
    if size % itemsize:
        raise DataError(f"data.path: {path} has {size} bytes, not a whole number of "
                        f"{dtype} tokens; is data.dtype right?")
    if remote:
        return remote_file.RemoteArray(path, dtype, remote_file.cache_for(c), size)
    return np.memmap(path, dtype=dtype, mode="r")


def _check_vocab(tokens, vocab_size: int, name: str) -> None:
    """Every id below model.vocab_size: all of a local file; of a file on object storage,
    8 evenly spaced blocks (a wrong data.dtype shows in any of them; reading the whole file
    would defeat reading only the rows trained on)."""
    top = tokens.sampled_max() if isinstance(tokens, remote_file.RemoteArray) \
        else int(tokens.max())
    if top >= vocab_size:
        hint = ""
        if tokens.dtype == np.uint32 and top >= 1 << 16:
            hint = ("; if the file holds uint16 tokens (nanoGPT's default), set "
                    "data.dtype=uint16")
        raise DataError(f"{name} holds token id {top}, outside model.vocab_size={vocab_size} "
                        f"(read as data.dtype={tokens.dtype}){hint}")


def _split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


def _stdlib_tokens(c) -> tuple[np.ndarray, np.ndarray]:
    return _split(stdlib_corpus(), c.data.val_fraction)


def _bin_tokens(c) -> tuple[np.ndarray, np.ndarray]:
    path, dtype, vocab = storage.as_path(c.data.path, "data.path"), c.data.dtype, c.model.vocab_size
    if path.is_dir():
        train = _memmap(path / "train.bin", dtype, c)
        val = _memmap(path / "val.bin", dtype, c)
        _check_vocab(train, vocab, str(path / "train.bin"))
        _check_vocab(val, vocab, str(path / "val.bin"))
        return train, val
    tokens = _memmap(path, dtype, c)
    _check_vocab(tokens, vocab, str(path))
    return _split(tokens, c.data.val_fraction)


def _windows(tokens_of: Callable) -> Callable:
    """splits() of a source of flat token arrays: non-overlapping windows over each."""
    def splits(c):
        train, val = tokens_of(c)
        name = f"data.source={c.data.source!r}"
        return (TokenWindows(train, c.model.seq_len, f"the training split of {name}"),
                TokenWindows(val, c.model.seq_len, f"the validation split of {name}"))
    return splits


def _synthetic_splits(c):
    seq, vocab = c.model.seq_len, c.model.vocab_size
    rows = LAYOUTS[c.data.packing].synthetic
    return (rows(vocab, seq, c.seed),
            rows(vocab, seq, c.seed + 1, size=c.eval_batches * c.train.global_batch))


def _check_synthetic(c) -> None:
    if LAYOUTS[c.data.packing].synthetic is None:
        fail("data.packing", c.data.packing, "data.source='synthetic' has no synthetic rows "
             "of this layout; use data.source='prepared'")


def _check_stdlib(c) -> None:
    if c.model.vocab_size < 256:
        fail("model.vocab_size", c.model.vocab_size, "the byte-level stdlib corpus needs >= 256")


def _check_bin(c) -> None:
    if not c.data.path:
        fail("data.path", "", "data.source='bin' needs a .bin file or a directory holding "
             "train.bin and val.bin")
    if c.data.dtype not in ("uint16", "uint32"):
        fail("data.dtype", c.data.dtype, "valid values are uint16, uint32")
    if c.data.tokenizer:
        tokenizers.require_tokenizer_package(c.data.tokenizer, "data.tokenizer")


def _check_prompts(c) -> None:
    if not c.data.path:
        fail("data.path", "", "data.source='prompts' needs a prompt set (a directory made by "
             "jaxtrain prepare --prompts)")


def _stdlib_fingerprint(c) -> dict:
    return {"the stdlib corpus": fingerprints.stdlib_corpus(stdlib_files()),
            "data.val_fraction": fingerprints.value(c.data.val_fraction)}


def _bin_fingerprint(c) -> dict:
    path = storage.as_path(c.data.path, "data.path")
    if path.is_dir():
        return {f"data.path {name}": fingerprints.token_file(path / name)
                for name in ("train.bin", "val.bin")}
    return {"data.path": fingerprints.token_file(path),
            "data.val_fraction": fingerprints.value(c.data.val_fraction)}


def _synthetic_fingerprint(c) -> dict:
    return {"synthetic tokens": fingerprints.item("synthetic-v1", "synthetic tokens")}


def _bin_tokenizer(c) -> tokenizers.Tokenizer | None:
    return tokenizers.load_tokenizer(c.data.tokenizer, "data.tokenizer") if c.data.tokenizer \
        else None


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One `data.source`: its config checks (before anything compiles), its splits, what
    it is (fingerprint) and the tokenizer that made its ids."""

    name: str
    doc: str
    splits: Callable  # config -> (train, validation) random-access windows of seq_len + 1
    check: Callable | None = None  # config -> None, raising ConfigError
    byte_level: bool = False  # a token is a byte: text prompts, bits per byte
    # The (train, validation) flat token arrays, for sources that have them (evaluation
    # reads consecutive windows of the validation tokens).
    tokens: Callable | None = None
    # config -> {item: {fingerprint, about}}: what a run records and checks on resume
    # (jaxtrain.data.record); None: only the source's name is recorded.
    fingerprint: Callable | None = None
    tokenizer: Callable | None = None  # config -> Tokenizer | None (None: not known)
    validation_text: bool = True  # has held-out data to evaluate on
    documents: bool = False  # knows its documents (a layout that needs them: data/layouts.py)
    reads_path: bool = False  # reads data.path (a path given to any other is refused)

    def fingerprints(self, c) -> dict:
        items = ({"data.source": fingerprints.item(self.name, repr(self.name))}
                 if self.fingerprint is None else self.fingerprint(c))
        if LAYOUTS[c.data.packing].recorded:
            items["data.packing"] = fingerprints.value(c.data.packing)
        return items

    def validate(self, c) -> None:
        if c.data.path and not self.reads_path:
            readers = " or ".join(repr(s.name) for s in SOURCES.values() if s.reads_path)
            fail("data.path", c.data.path, f"data.source={self.name!r} reads no path (it "
                 f"would train on {self.doc}); data.path is read by data.source={readers}: "
                 "set data.source, or drop data.path")
        if LAYOUTS[c.data.packing].documents and not self.documents:
            fail("data.packing", c.data.packing, f"data.source={self.name!r} has no document "
                 "index; use data.source='prepared' (jaxtrain prepare --stdlib makes one of "
                 "the built-in corpus) or 'synthetic'")
        if self.check is not None:
            self.check(c)


SOURCES: dict[str, DataSource] = {s.name: s for s in (
    DataSource("stdlib", "the bytes of this Python's standard library sources",
               _windows(_stdlib_tokens), _check_stdlib, byte_level=True, tokens=_stdlib_tokens,
               fingerprint=_stdlib_fingerprint, tokenizer=lambda c: tokenizers.ByteTokenizer()),
    DataSource("bin", "nanoGPT-style flat uint16/uint32 token files", _windows(_bin_tokens),
               _check_bin, tokens=_bin_tokens, fingerprint=_bin_fingerprint,
               tokenizer=_bin_tokenizer, reads_path=True),
    DataSource("synthetic", "uniform random tokens, a function of (seed, index)",
               _synthetic_splits, _check_synthetic, fingerprint=_synthetic_fingerprint,
               validation_text=False,
               documents=True),
    DataSource(prepared_source.NAME, "datasets made by `jaxtrain prepare`, alone or mixed "
               "by weight (docs/data.md)", prepared_source.splits, prepared_source.check,
               fingerprint=prepared_source.fingerprint, tokenizer=prepared_source.tokenizer,
               documents=True, reads_path=True),
    DataSource("prompts", "a prompt set made by `jaxtrain prepare --prompts`, sampled from "
               "by train.objective='grpo'", prompt_set.splits, _check_prompts,
               fingerprint=prompt_set.fingerprint, tokenizer=prompt_set.tokenizer,
               validation_text=False, reads_path=True),
)}


def defaults() -> dict:
    """The `data` section of config.base_config() (docs/data.md)."""
    return {
        "source": "stdlib",
        # bin: a .bin file or a directory with train.bin/val.bin; prepared: a directory made
        # by `jaxtrain prepare` (docs/data.md).
        "path": "",
        "dtype": "uint16",  # token width of .bin files
        "val_fraction": 0.05,  # held-out tail (prepared: at a document boundary)
        "prefetch": 2,
        # The batch layout (data/layouts.py LAYOUTS): concat, rows are windows of the
        # concatenated documents; documents, whole documents packed into rows, attention and
        # positions kept within each (data/packing.py); pairs, a preference pair per row.
        "packing": "concat",
        # prepared: several datasets drawn by weight, "DIR:WEIGHT,DIR:WEIGHT" (instead of path).
        "mixture": "",
        # prepared: validate on this prepared dataset instead of a held-out tail.
        "val_path": "",
        # bin: the tokenizer that made the ids (a spec as for prepare --tokenizer), so that
        # generate/eval/convert can use text; prepared datasets carry their own.
        "tokenizer": "",
        # Resume even though the data's fingerprint changed since the run started (data.json).
        "allow_changed": False,
        # Data on gs:// or s3://: read by range requests of block_kb KiB into an in-memory
        # LRU cache of cache_mb MiB per process (data/remote_file.py).
        "cache_mb": 512,
        "block_kb": 256,
    }
