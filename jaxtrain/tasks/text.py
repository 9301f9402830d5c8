"""The text side of a run for task evaluation: its tokenizer, and the token that stands for
"no context" (a document boundary).

Today a run's tokens are text only where its data source is byte-level (a token is a UTF-8
byte: the built-in stdlib corpus). Runs that trained on token files carry no tokenizer yet
(issue 16 stores one in the workdir); until then they cannot be evaluated on text tasks.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

from jaxtrain.data.sources import SOURCES
from jaxtrain.errors import ConfigError


class ByteTokenizer:
    """A token is a UTF-8 byte (vocabulary 256, no special tokens)."""

    kind = "bytes"
    vocab_size = 256
    eos_id: int | None = None
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> str:
        return "bytes (UTF-8, 256 ids)"


def check_text(cfg, key: str) -> None:
    """ConfigError naming `key` when the run has no tokenizer to turn task text into ids."""
    if not SOURCES[cfg.data.source].byte_level:
        raise ConfigError(f"{key} needs the run's tokenizer, and data.source="
                          f"{cfg.data.source!r} has none stored with the run (only "
                          "byte-level runs, such as data.source='stdlib', have text today)")


def run_tokenizer(cfg, workdir: pathlib.Path | None = None) -> ByteTokenizer:
    """The tokenizer a run's ids belong to."""
    del workdir  # where issue 16 stores the run's tokenizer
    check_text(cfg, "task evaluation")
    return ByteTokenizer()


def boundary_id(tokenizer) -> int:
    """The token that conditions text with no context (lm_eval's prefix token): BOS, else
    EOS, else a newline — what separates the files of a byte-level corpus."""
    for token in (tokenizer.bos_id, tokenizer.eos_id):
        if token is not None:
            return token
    return tokenizer.encode("\n")[-1]
