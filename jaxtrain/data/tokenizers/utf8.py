"""The `bytes` kind: a token is a UTF-8 byte (the built-in stdlib corpus; 256 ids, no EOS)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np
import tokenizers as hf

from jaxtrain.data.tokenizers.base import Tokenizer, TokenizerKind, bytes_to_unicode, sha256


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

    def encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        widths = np.asarray([len(c.encode("utf-8")) for c in text], dtype=np.int64)
        char_of_byte = np.repeat(np.arange(len(text)), widths)  # each byte: its character
        return (np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32),
                char_of_byte, char_of_byte + 1)

    def fingerprint(self) -> str:
        return sha256("jaxtrain-bytes-v1")

    def describe(self) -> str:
        return "bytes (UTF-8, 256 ids)"

    def _save_files(self, directory: pathlib.Path) -> dict:
        return {}

    def token_bytes(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)

    def to_hf(self):
        """A BPE with no merges whose vocabulary is the 256 byte stand-ins, id = byte value."""
        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        backend = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                            use_regex=False)
        backend.decoder = hf.decoders.ByteLevel()
        return backend


KIND = TokenizerKind(
    "bytes", "bytes", load_saved=lambda directory, meta, what: ByteTokenizer(),
    names=lambda spec: spec == "bytes", load_spec=lambda spec, what: ByteTokenizer())
