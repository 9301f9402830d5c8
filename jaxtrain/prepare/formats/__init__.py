"""Input formats of `jaxtrain prepare`: one module per format, each with its InputFormat
entry (base.py) in FORMATS, so that a new format is one module and one entry here."""

from __future__ import annotations

import pathlib

from jaxtrain.prepare.formats import hf, jsonl, parquet, text
from jaxtrain.prepare.formats.base import InputFormat

# In the order --format lists them; auto tries each but the fallback (text), then it.
FORMATS = {f.name: f for f in (text.FORMAT, jsonl.FORMAT, parquet.FORMAT, hf.FORMAT)}

__all__ = ["FORMATS", "InputFormat", "format_of"]


def format_of(path: pathlib.Path, forced: str) -> str:
    """The format of an input path: `forced` unless auto, else the first that claims it."""
    if forced != "auto":
        return forced
    candidates = ([f for f in FORMATS.values() if not f.fallback]
                  + [f for f in FORMATS.values() if f.fallback])
    return next(f.name for f in candidates if f.claims(path) or f.fallback)
