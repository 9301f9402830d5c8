"""The `huggingface` kind: a `tokenizers.Tokenizer` (the Rust library behind every fast HF
tokenizer), from a tokenizer.json or a model directory; a directory with other tokenizer
files (e.g. GPT-2's vocab.json + merges.txt) goes through transformers' AutoTokenizer with
local files only. The fallback: any file or directory no other kind claims is tried as one."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import numpy as np
import tokenizers as hf

from jaxtrain.data.tokenizers.base import (
    HF_FILE,
    Tokenizer,
    TokenizerKind,
    bytes_to_unicode,
    piece_bytes,
    read_json,
    sha256,
)
from jaxtrain.errors import DataError

# Special tokens recognised as end/begin of a document when a tokenizer.json says no more.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")


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
        self._rendering = None

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

    def encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._rendering is None:  # a copy that reads special tokens' text as them
            self._rendering = hf.Tokenizer.from_str(self.backend.to_str())
            self._rendering.encode_special_tokens = False
        encoding = self._rendering.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.uint32), offsets[:, 0], offsets[:, 1]

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = sha256("huggingface", self.backend.to_str(),
                                       str(self.eos_id), str(self.bos_id))
        return self._fingerprint

    def _save_files(self, directory: pathlib.Path) -> dict:
        self.backend.save(str(directory / HF_FILE))
        return {"files": [HF_FILE]}

    def token_bytes(self) -> np.ndarray:
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        byte_level = "ByteLevel" in json.dumps(decoder)
        table = np.zeros(self.vocab_size, dtype=np.int64)
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        for i in range(self.vocab_size):
            token = self.backend.id_to_token(i)
            if token is None or i in special:
                continue
            table[i] = piece_bytes(token, byte_of if byte_level else None)
        return table

    def to_hf(self):
        return self.backend


def _load_saved(directory: pathlib.Path, meta: dict, what: str) -> HFTokenizer:
    if (directory / HF_FILE).is_file():
        config = meta or read_json(directory / "tokenizer_config.json")
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


KIND = TokenizerKind(
    "huggingface", "a tokenizer.json", load_saved=_load_saved,
    holds_file=lambda path: True, load_file=HFTokenizer.from_file, fallback=True)
