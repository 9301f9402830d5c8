"""What every tokenizer kind shares: the interface, the saved-directory files, the registry
entry's shape, and the byte tables that bits per byte are counted with."""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import pathlib
import re
import shutil
from collections.abc import Callable, Sequence

import numpy as np
import tokenizers as hf

from jaxtrain import storage
from jaxtrain.errors import DataError

META_FILE = "jaxtrain_tokenizer.json"
HF_FILE = "tokenizer.json"
SPM_FILE = "tokenizer.model"
TIKTOKEN_FILE = "tokenizer.tiktoken"
# The meta kind of a directory that records that a model's ids have no known tokenizer (a
# Hugging Face import without tokenizer files): nothing may stand in for it.
NO_TOKENIZER = "none"
# Encoded by every tokenizer before an HF export is written: the export must give these ids.
PROBE_TEXT = ("Hello, world! def f(x):\n    return x ** 2  # ünïcödé ✓ 日本語 🙂\n\n"
              "  two  spaces, tabs\tand 12345 numbers.")


def sha256(*parts: bytes | str) -> str:
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

    def encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, first character, character after the last) of each token of a rendered
        chat template: text spelling a special token IS that token here, as transformers
        tokenizes apply_chat_template's output (jaxtrain.prepare.chat)."""
        raise DataError(f"--chat: a {self.kind} tokenizer cannot encode a chat with character "
                        "offsets yet; use a Hugging Face tokenizer (tokenizer.json) or bytes")

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

    def save(self, directory, extra: dict[str, str] | None = None):
        """Writes the tokenizer (and `extra` {file name: text} beside it, e.g. a chat
        template) into a staging directory, the meta file last, then commits it to
        `directory` whole (storage.commit_files: a rename on disk, the meta file uploaded
        last on a bucket): a reader never finds half a tokenizer."""
        directory = storage.as_path(directory)
        staged = storage.staging_dir(directory, "tokenizer")
        shutil.rmtree(staged, ignore_errors=True)  # a killed save's: written again whole
        staged.mkdir(parents=True)
        for name, text in (extra or {}).items():
            (staged / name).write_text(text)
        more = self._save_files(staged)
        write_json(staged / META_FILE, {**self.meta(), **more})
        storage.commit_files(staged, directory, META_FILE)
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
        write_json(directory / "tokenizer_config.json", config)


def _never(_) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class TokenizerKind:
    """One tokenizer backend, as `load_tokenizer` finds and loads it. A spec names a kind
    by itself (`names`, e.g. `tiktoken:NAME`), is a file of it (`holds_file`), or is a
    directory: a saved one whose meta file says `name`, or a model directory without one
    that `in_directory` recognises. `fallback`: what a file or directory no other kind
    claims is tried as (Hugging Face's tokenizer.json and model directories)."""

    name: str
    spec: str  # how a --tokenizer names it, for messages ("a SentencePiece .model")
    load_saved: Callable  # (directory, meta, what) -> Tokenizer
    names: Callable[[str], bool] = _never
    load_spec: Callable | None = None  # (spec, what) -> Tokenizer
    holds_file: Callable[[pathlib.Path], bool] = _never
    load_file: Callable | None = None  # (path) -> Tokenizer
    in_directory: Callable[[pathlib.Path], bool] = _never
    package: str | None = None  # what it runs on beyond the tokenizers dependency
    export_package: str | None = None  # what its Hugging Face export is converted with
    fallback: bool = False


def write_json(path: pathlib.Path, value) -> None:
    storage.write_json(path, value, indent=2, sort_keys=True)


def read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None


def bytes_to_unicode() -> dict[int, str]:
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


def piece_bytes(piece: str, byte_of: dict | None) -> int:
    """Bytes a vocabulary piece stands for: byte-level pieces map each char to one byte;
    SentencePiece pieces write a space as '▁' and byte fallbacks as <0xNN>."""
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return 1
    if byte_of is not None and all(c in byte_of for c in piece):
        return len(piece)
    return len(piece.replace("▁", " ").encode("utf-8"))
