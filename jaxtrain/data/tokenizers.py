"""Tokenizers: one small interface over the field's libraries, saved with datasets and runs.

Entries (`load_tokenizer(spec)`):
- `bytes`: a token is a UTF-8 byte (the built-in stdlib corpus; vocabulary 256, no EOS).
- a Hugging Face `tokenizer.json`, or a model directory holding one (the `tokenizers`
  library); a directory with other tokenizer files (e.g. GPT-2's vocab.json + merges.txt) goes
  through transformers' AutoTokenizer with local files only.
- a SentencePiece `.model` (or a directory holding `tokenizer.model` and no tokenizer.json).
- `tiktoken:NAME`: a tiktoken encoding from tiktoken's cache or the network.
`train_bpe` trains a byte-level BPE with the `tokenizers` trainer.

A saved tokenizer is a directory: the library's own file plus `jaxtrain_tokenizer.json`
(kind, vocabulary size, EOS/BOS ids, fingerprint), so it loads back offline with the same
ids. The fingerprint is a hash of what decides the ids, not of where the files are.
"""

from __future__ import annotations

import abc
import base64
import hashlib
import json
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np
import tokenizers as hf

from jaxtrain import storage
from jaxtrain.errors import DataError, require_package

META_FILE = "jaxtrain_tokenizer.json"
HF_FILE = "tokenizer.json"
SPM_FILE = "tokenizer.model"
TIKTOKEN_FILE = "tokenizer.tiktoken"
# The package each kind of tokenizer runs on (bytes and tokenizer.json need none beyond
# the tokenizers dependency).
KIND_PACKAGES = {"tiktoken": "tiktoken", "sentencepiece": "sentencepiece"}
# The meta kind of a directory that records that a model's ids have no known tokenizer (a
# Hugging Face import without tokenizer files): nothing may stand in for it.
NO_TOKENIZER = "none"
# Special tokens recognised as end/begin of a document when a tokenizer.json says no more.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
# Encoded by every tokenizer before an HF export is written: the export must give these ids.
PROBE_TEXT = ("Hello, world! def f(x):\n    return x ** 2  # ünïcödé ✓ 日本語 🙂\n\n"
              "  two  spaces, tabs\tand 12345 numbers.")


def _sha256(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8") if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


class Tokenizer(abc.ABC):
    """Text <-> token ids. Documents are encoded without special tokens, and text spelling
    one is encoded as text: whether a document gets a BOS/EOS is the dataset's policy
    (jaxtrain.prepare.pipeline), not the tokenizer's."""

    kind: str
    vocab_size: int
    eos_id: int | None = None
    bos_id: int | None = None

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(self.encode(t), dtype=np.uint32) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """sha256 of what decides the ids (files and settings), not of the path."""

    @abc.abstractmethod
    def _save_files(self, directory: pathlib.Path) -> dict:
        """Writes the library's file(s); returns extra fields for the meta file."""

    @abc.abstractmethod
    def token_bytes(self) -> np.ndarray:
        """[vocab_size] int: the UTF-8 bytes each id stands for (0 for special tokens), so
        that bits per byte come from real byte counts."""

    @abc.abstractmethod
    def to_hf(self):
        """A `tokenizers.Tokenizer` giving the same ids (for a Hugging Face export)."""

    def describe(self) -> str:
        return f"{self.kind} tokenizer ({self.vocab_size} ids, sha256 {self.fingerprint()[:12]})"

    def meta(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "fingerprint": self.fingerprint()}

    def save(self, directory) -> pathlib.Path:
        """Writes the tokenizer into `directory` (created); the meta file is written last."""
        directory = storage.as_path(directory)
        if storage.is_remote(directory):  # the libraries write local files: stage them
            with tempfile.TemporaryDirectory() as staged:
                self.save(staged)
                storage.upload_tree(pathlib.Path(staged), directory, last=META_FILE)
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        extra = self._save_files(directory)
        _write_json(directory / META_FILE, {**self.meta(), **extra})
        return directory

    def save_hf(self, directory) -> None:
        """tokenizer.json + tokenizer_config.json that transformers.AutoTokenizer loads and
        that encode exactly as this tokenizer does (checked on a probe text)."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            backend = self.to_hf()
        except (ImportError, AttributeError) as e:  # converters of transformers 5
            raise DataError(f"exporting a {self.kind} tokenizer needs transformers >= 5 "
                            f"({e})") from None
        ours = self.encode(PROBE_TEXT)
        theirs = backend.encode(PROBE_TEXT, add_special_tokens=False).ids
        if ours != theirs:
            raise DataError(f"the Hugging Face form of this {self.kind} tokenizer encodes "
                            "differently from it; not exporting a tokenizer that would change "
                            "the ids")
        backend.save(str(directory / HF_FILE))
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False}
        for role, token_id in (("eos_token", self.eos_id), ("bos_token", self.bos_id)):
            if token_id is not None:
                config[role] = backend.id_to_token(token_id)
        _write_json(directory / "tokenizer_config.json", config)


def _write_json(path: pathlib.Path, value) -> None:
    storage.write_json(path, value, indent=2, sort_keys=True)


# --- bytes ---------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what the tokenizers ByteLevel step uses)."""
    alphabet = hf.pre_tokenizers.ByteLevel.alphabet()
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    assert set(table.values()) == set(alphabet)
    return table


class ByteTokenizer(Tokenizer):
    """The identity on UTF-8 bytes: what the built-in corpus and configs/tiny.py train on."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return _sha256("jaxtrain-bytes-v1")

    def describe(self) -> str:
        return "bytes (UTF-8, 256 ids)"

    def _save_files(self, directory: pathlib.Path) -> dict:
        return {}

    def token_bytes(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)

    def to_hf(self):
        """A BPE with no merges whose vocabulary is the 256 byte stand-ins, id = byte value."""
        vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
        backend = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                            use_regex=False)
        backend.decoder = hf.decoders.ByteLevel()
        return backend


# --- Hugging Face tokenizers ---------------------------------------------------------------

def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (the Rust library behind every fast HF tokenizer)."""

    kind = "huggingface"

    def __init__(self, backend, eos_id: int | None = None, bos_id: int | None = None):
        # Text that spells a special token ("<|endoftext|>" in code about tokenizers) stays
        # text: only the dataset's policy puts EOS/BOS ids between documents. (Not saved in
        # tokenizer.json, so an exported tokenizer keeps transformers' usual behaviour.)
        backend.encode_special_tokens = True
        self.backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eos_id, self.bos_id = eos_id, bos_id
        self._fingerprint = None

    @classmethod
    def from_file(cls, path: pathlib.Path, config: dict | None = None) -> HFTokenizer:
        try:
            backend = hf.Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise DataError(f"{path}: not a readable tokenizer.json ({e})") from None
        return cls.with_special_ids(backend, config or {})

    @classmethod
    def with_special_ids(cls, backend, config: dict) -> HFTokenizer:
        """EOS/BOS from a tokenizer_config.json (or our meta file), else by their usual names."""
        found = {}
        for role, names in (("eos", EOS_NAMES), ("bos", BOS_NAMES)):
            if f"{role}_id" in config:
                found[role] = config[f"{role}_id"]
                continue
            name = _token_content(config.get(f"{role}_token"))
            candidates = [name] if name else [
                t.content for t in backend.get_added_tokens_decoder().values()
                if t.special and t.content in names]
            ids = [backend.token_to_id(c) for c in candidates if c]
            found[role] = next((i for i in ids if i is not None), None)
        return cls(backend, eos_id=found["eos"], bos_id=found["bos"])

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self.backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _sha256("huggingface", self.backend.to_str(),
                                        str(self.eos_id), str(self.bos_id))
        return self._fingerprint

    def _save_files(self, directory: pathlib.Path) -> dict:
        self.backend.save(str(directory / HF_FILE))
        return {"files": [HF_FILE]}

    def token_bytes(self) -> np.ndarray:
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        byte_level = "ByteLevel" in json.dumps(decoder)
        table = np.zeros(self.vocab_size, dtype=np.int64)
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        for i in range(self.vocab_size):
            token = self.backend.id_to_token(i)
            if token is None or i in special:
                continue
            table[i] = _piece_bytes(token, byte_of if byte_level else None)
        return table

    def to_hf(self):
        return self.backend


def _piece_bytes(piece: str, byte_of: dict | None) -> int:
    """Bytes a vocabulary piece stands for: byte-level pieces map each char to one byte;
    SentencePiece pieces write a space as '▁' and byte fallbacks as <0xNN>."""
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return 1
    if byte_of is not None and all(c in byte_of for c in piece):
        return len(piece)
    return len(piece.replace("▁", " ").encode("utf-8"))


# --- SentencePiece -------------------------------------------------------------------------

class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: pathlib.Path):
        import sentencepiece

        self.path = pathlib.Path(path)
        self.model_bytes = self.path.read_bytes()
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(self.model_bytes)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{path}: not a SentencePiece model ({e})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.uint32) for ids in self.sp.encode(list(texts),
                                                                          num_threads=1)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        return _sha256("sentencepiece", self.model_bytes)

    def _save_files(self, directory: pathlib.Path) -> dict:
        (directory / SPM_FILE).write_bytes(self.model_bytes)
        return {"files": [SPM_FILE]}

    def token_bytes(self) -> np.ndarray:
        table = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if self.sp.is_control(i) or self.sp.is_unknown(i):
                continue
            table[i] = 1 if self.sp.is_byte(i) else _piece_bytes(self.sp.id_to_piece(i), None)
        return table

    def to_hf(self):
        from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

        extractor = SentencePieceExtractor(str(self.path))
        proto = extractor.proto
        if proto.trainer_spec.model_type == 1:  # unigram
            vocab = [(p.piece, p.score) for p in proto.pieces]
        else:
            vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
        if backend is None:
            raise DataError(f"{self.path}: this SentencePiece model type has no Hugging Face "
                            "form")
        backend.add_special_tokens([hf.AddedToken(p.piece, special=True, normalized=False)
                                    for p in proto.pieces if p.type == 3])
        return backend


# --- tiktoken ------------------------------------------------------------------------------

class TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"

    def __init__(self, encoding):
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab
        self.eos_id = encoding._special_tokens.get("<|endoftext|>")
        self.bos_id = None

    @classmethod
    def from_parts(cls, name: str, pat_str: str, ranks: dict[bytes, int],
                   special_tokens: dict[str, int]) -> TiktokenTokenizer:
        import tiktoken

        return cls(tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=special_tokens))

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.uint32)
                for ids in self.encoding.encode_ordinary_batch(list(texts), num_threads=1)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def _ranks_text(self) -> bytes:
        ranks = self.encoding._mergeable_ranks
        return b"".join(base64.b64encode(token) + b" " + str(rank).encode() + b"\n"
                        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]))

    def fingerprint(self) -> str:
        specials = json.dumps(self.encoding._special_tokens, sort_keys=True)
        return _sha256("tiktoken", self.encoding._pat_str, specials, self._ranks_text())

    def _save_files(self, directory: pathlib.Path) -> dict:
        (directory / TIKTOKEN_FILE).write_bytes(self._ranks_text())
        return {"files": [TIKTOKEN_FILE], "name": self.encoding.name,
                "pat_str": self.encoding._pat_str,
                "special_tokens": self.encoding._special_tokens}

    def token_bytes(self) -> np.ndarray:
        table = np.zeros(self.vocab_size, dtype=np.int64)
        for token, rank in self.encoding._mergeable_ranks.items():
            table[rank] = len(token)
        return table

    def to_hf(self):
        from transformers.convert_slow_tokenizer import TikTokenConverter

        with tempfile.TemporaryDirectory() as tmp:
            ranks = pathlib.Path(tmp) / TIKTOKEN_FILE
            ranks.write_bytes(self._ranks_text())
            backend = TikTokenConverter(vocab_file=str(ranks),
                                        pattern=self.encoding._pat_str).converted()
        specials = sorted(self.encoding._special_tokens.items(), key=lambda kv: kv[1])
        for content, token_id in specials:
            if backend.get_vocab_size(with_added_tokens=True) != token_id:
                raise DataError("tiktoken special tokens that leave gaps in the vocabulary "
                                "have no Hugging Face form here")
            backend.add_special_tokens([hf.AddedToken(content, special=True, normalized=False)])
        return backend


def _tiktoken_by_name(name: str) -> TiktokenTokenizer:
    try:
        import tiktoken
    except ImportError:
        raise DataError(f"tokenizer tiktoken:{name} needs the tiktoken package: pip install "
                        "'jaxtrain[data]'") from None
    try:
        return TiktokenTokenizer(tiktoken.get_encoding(name))
    except ValueError as e:
        raise DataError(f"tokenizer tiktoken:{name}: {e}") from None
    except OSError:  # requests' ConnectionError is an OSError
        raise DataError(f"tokenizer tiktoken:{name}: its BPE file is not in tiktoken's cache "
                        "and cannot be downloaded here (no network); fetch it once where "
                        "there is network and point TIKTOKEN_CACHE_DIR at that cache") from None


def _load_tiktoken_saved(directory: pathlib.Path, meta: dict) -> TiktokenTokenizer:
    ranks = {}
    for line in (directory / TIKTOKEN_FILE).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return TiktokenTokenizer.from_parts(meta["name"], meta["pat_str"], ranks,
                                        meta["special_tokens"])


# --- loading -------------------------------------------------------------------------------

def load_tokenizer(spec, what: str = "--tokenizer") -> Tokenizer:
    """A tokenizer from `bytes`, `tiktoken:NAME`, a tokenizer.json, a SentencePiece .model or
    a directory (a saved jaxtrain tokenizer or a Hugging Face model directory)."""
    spec = str(spec)
    if spec == "bytes":
        return ByteTokenizer()
    require_tokenizer_package(spec, what)
    if spec.startswith("tiktoken:"):
        return _tiktoken_by_name(spec.split(":", 1)[1])
    path = pathlib.Path(os.path.expanduser(spec))
    if path.is_dir():
        return _load_directory(path, what)
    if path.is_file():
        if path.suffix == ".model":
            return _sentencepiece(path)
        return HFTokenizer.from_file(path)
    raise DataError(f"{what}={spec}: no such file or directory; give bytes, tiktoken:NAME, a "
                    "tokenizer.json, a SentencePiece .model or a model directory")


def _sentencepiece(path: pathlib.Path) -> SentencePieceTokenizer:
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        raise DataError(f"{path}: SentencePiece models need the sentencepiece package: pip "
                        "install 'jaxtrain[data]'") from None
    return SentencePieceTokenizer(path)


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None


def kind_of(spec) -> str | None:
    """The kind of tokenizer a spec names, told from its name and a directory's meta file
    without loading it; None when only loading tells (a tokenizer.json, a model directory)."""
    spec = str(spec)
    if spec.startswith("tiktoken:"):
        return "tiktoken"
    path = pathlib.Path(os.path.expanduser(spec))
    if path.is_file() and path.suffix == ".model":
        return "sentencepiece"
    return _directory_kind(path, _read_json(path / META_FILE)) if path.is_dir() else None


def require_tokenizer_package(spec, what: str = "--tokenizer") -> None:
    """DataError (one line) when the package that tokenizer `spec` runs on is missing:
    checked before a prepare or a run writes anything, and without importing it."""
    kind = kind_of(spec)
    if kind in KIND_PACKAGES:
        require_package(KIND_PACKAGES[kind], f"{what}={spec} (a {kind} tokenizer)",
                        error=DataError)


def _directory_kind(directory: pathlib.Path, meta: dict) -> str | None:
    kind = meta.get("kind")
    if kind is None and (directory / SPM_FILE).is_file() and not (directory / HF_FILE).is_file():
        return "sentencepiece"  # a model directory with only a SentencePiece model
    return kind


def _load_directory(directory: pathlib.Path, what: str) -> Tokenizer:
    meta = _read_json(directory / META_FILE)
    kind = _directory_kind(directory, meta)
    if kind == NO_TOKENIZER:
        raise DataError(f"{what}={directory}: records that the model has no tokenizer")
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "tiktoken":
        return _load_tiktoken_saved(directory, meta)
    if kind == "sentencepiece":
        return _sentencepiece(directory / SPM_FILE)
    if (directory / HF_FILE).is_file():
        config = meta or _read_json(directory / "tokenizer_config.json")
        return HFTokenizer.from_file(directory / HF_FILE, config)
    return _auto_tokenizer(directory, what)


def _auto_tokenizer(directory: pathlib.Path, what: str) -> HFTokenizer:
    """Model directories with other tokenizer files: transformers builds the fast form."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{what}={directory}: holds no tokenizer.json; reading its other "
                        "tokenizer files needs transformers") from None
    try:
        loaded = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{what}={directory}: no tokenizer found there "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"{what}={directory}: its tokenizer has no fast (tokenizers) form")
    return HFTokenizer(backend, eos_id=loaded.eos_token_id, bos_id=loaded.bos_token_id)


def read_meta(directory) -> dict | None:
    """The meta file of a saved tokenizer, or None."""
    path = storage.as_path(directory) / META_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def copy_saved(source, target) -> None:
    """Copies a saved tokenizer directory (meta file last, so a partial copy is not one)."""
    source, target = pathlib.Path(source), pathlib.Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        if item.name != META_FILE and item.is_file():
            shutil.copyfile(item, target / item.name)
    shutil.copyfile(source / META_FILE, target / META_FILE)


# --- training ------------------------------------------------------------------------------

def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None,
              show_progress: bool = False, eos: str = "<|endoftext|>") -> HFTokenizer:
    """A byte-level BPE (GPT-2's scheme) trained on `texts`; `eos` is its one special token.
    Deterministic: the same texts in the same order give the same merges."""
    if vocab_size < 257:
        raise DataError(f"--train-tokenizer={vocab_size} is invalid: a byte-level BPE needs "
                        "at least 257 ids (256 bytes and the end-of-text token)")
    backend = hf.Tokenizer(hf.models.BPE())
    backend.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                     initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=show_progress)
    backend.train_from_iterator(texts, trainer, length=length)
    return HFTokenizer(backend, eos_id=backend.token_to_id(eos), bos_id=None)
