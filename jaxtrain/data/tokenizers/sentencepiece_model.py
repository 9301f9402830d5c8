"""The `sentencepiece` kind: a SentencePiece `.model`, or a model directory holding
`tokenizer.model` and no tokenizer.json."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np
import tokenizers as hf

from jaxtrain.data.tokenizers.base import (
    HF_FILE,
    SPM_FILE,
    Tokenizer,
    TokenizerKind,
    piece_bytes,
    sha256,
)
from jaxtrain.errors import DataError


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
        return sha256("sentencepiece", self.model_bytes)

    def _save_files(self, directory: pathlib.Path) -> dict:
        (directory / SPM_FILE).write_bytes(self.model_bytes)
        return {"files": [SPM_FILE]}

    def token_bytes(self) -> np.ndarray:
        table = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if self.sp.is_control(i) or self.sp.is_unknown(i):
                continue
            table[i] = 1 if self.sp.is_byte(i) else piece_bytes(self.sp.id_to_piece(i), None)
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


def load(path: pathlib.Path) -> SentencePieceTokenizer:
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        raise DataError(f"{path}: SentencePiece models need the sentencepiece package: pip "
                        "install 'jaxtrain[data]'") from None
    return SentencePieceTokenizer(path)


def _only_a_model(directory: pathlib.Path) -> bool:
    """A model directory with only a SentencePiece model (no tokenizer.json beside it)."""
    return (directory / SPM_FILE).is_file() and not (directory / HF_FILE).is_file()


KIND = TokenizerKind(
    "sentencepiece", "a SentencePiece .model",
    load_saved=lambda directory, meta, what: load(directory / SPM_FILE),
    holds_file=lambda path: path.suffix == ".model", load_file=load,
    in_directory=_only_a_model, package="sentencepiece", export_package="transformers")
