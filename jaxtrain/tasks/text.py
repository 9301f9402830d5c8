"""The text side of a run for task evaluation: the tokenizer its ids belong to, and the
token that stands for "no context" (a document boundary).

The tokenizer travels with the run (data/record.py): a checkpoint is evaluated with
WORKDIR/tokenizer (bytes for runs on the built-in corpus made before it was stored), the
training loop with the tokenizer that made the ids it trains on (its data source's).
"""

from __future__ import annotations

import pathlib

from jaxtrain.data import record
from jaxtrain.data.sources import SOURCES
from jaxtrain.errors import DataError, fail


def check_text(cfg) -> None:
    """ConfigError for eval.tasks where the data source can have no tokenizer at all (the
    tokenizer itself is loaded, and its absence reported, with the tasks)."""
    if SOURCES[cfg.data.source].tokenizer is None:
        fail("eval.tasks", cfg.eval.tasks, f"tasks are text and data.source="
             f"{cfg.data.source!r} has no tokenizer; train on text (the stdlib or prepared "
             "sources, or .bin files with data.tokenizer)")


def data_tokenizer(cfg, key: str = "eval.tasks"):
    """The tokenizer that made the ids a run trains on (for the training loop)."""
    tokenizer = record.data_tokenizer(cfg)
    if tokenizer is None:
        raise DataError(f"{key} needs the tokenizer of the run's ids, and data.source="
                        f"{cfg.data.source!r} names none (for .bin files, set data.tokenizer)")
    return tokenizer


def run_tokenizer(cfg, workdir: pathlib.Path):
    """The tokenizer a run's checkpoints belong to (for evaluating a checkpoint)."""
    tokenizer = record.run_tokenizer(workdir, cfg)
    if tokenizer is None:
        raise DataError(f"--workdir={workdir} has no tokenizer (WORKDIR/tokenizer): its ids "
                        "cannot be turned into text; task evaluation needs one (a run on .bin "
                        "files names it with data.tokenizer)")
    return tokenizer


def boundary_id(tokenizer) -> int:
    """The token that conditions text with no context (lm_eval's prefix token): BOS, else
    EOS, else a newline — what separates the files of a byte-level corpus."""
    for token in (tokenizer.bos_id, tokenizer.eos_id):
        if token is not None:
            return token
    return tokenizer.encode("\n")[-1]
