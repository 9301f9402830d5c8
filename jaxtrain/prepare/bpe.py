"""Training a byte-level BPE on the inputs (`jaxtrain prepare --train-tokenizer VOCAB`):
offline only; the trained tokenizer is a `huggingface` one (jaxtrain.data.tokenizers)."""

from __future__ import annotations

from collections.abc import Iterable

import tokenizers as hf

from jaxtrain.data.tokenizers import HFTokenizer
from jaxtrain.errors import DataError


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
