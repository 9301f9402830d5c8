"""The `tiktoken` kind: `tiktoken:NAME`, an encoding from tiktoken's cache or the network,
saved as its ranks file plus the pattern and special tokens in the meta file."""

from __future__ import annotations

import base64
import json
import pathlib
import tempfile
from collections.abc import Sequence

import numpy as np
import tokenizers as hf

from jaxtrain.data.tokenizers.base import TIKTOKEN_FILE, Tokenizer, TokenizerKind, sha256
from jaxtrain.errors import DataError

PREFIX = "tiktoken:"


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
        return sha256("tiktoken", self.encoding._pat_str, specials, self._ranks_text())

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


def by_name(spec: str, what: str = "--tokenizer") -> TiktokenTokenizer:
    name = spec.split(":", 1)[1]
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


def load_saved(directory: pathlib.Path, meta: dict, what: str) -> TiktokenTokenizer:
    ranks = {}
    for line in (directory / TIKTOKEN_FILE).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return TiktokenTokenizer.from_parts(meta["name"], meta["pat_str"], ranks,
                                        meta["special_tokens"])


KIND = TokenizerKind(
    "tiktoken", "tiktoken:NAME", load_saved=load_saved,
    names=lambda spec: spec.startswith(PREFIX), load_spec=by_name,
    package="tiktoken", export_package="transformers")
