"""The tokenizer-kind registry and `load_tokenizer`: a spec is matched against each kind's
entry (base.TokenizerKind) instead of a chain of ifs, so that a new backend is one module
and one entry in KINDS."""

from __future__ import annotations

import json
import pathlib

from jaxtrain import storage
from jaxtrain.data.tokenizers import huggingface, sentencepiece_model, tiktoken_encoding, utf8
from jaxtrain.data.tokenizers.base import META_FILE, NO_TOKENIZER, Tokenizer, read_json
from jaxtrain.errors import DataError, require_package

# In the order specs are matched and listed in messages; the fallback kind is tried last.
KINDS = {kind.name: kind for kind in (utf8.KIND, tiktoken_encoding.KIND, huggingface.KIND,
                                      sentencepiece_model.KIND)}


def _ordered(with_fallback: bool = True):
    kinds = list(KINDS.values())
    return ([k for k in kinds if not k.fallback]
            + ([k for k in kinds if k.fallback] if with_fallback else []))


def _fallback():
    return next(k for k in KINDS.values() if k.fallback)


def load_tokenizer(spec, what: str = "--tokenizer") -> Tokenizer:
    """A tokenizer from a spec that names one (`bytes`, `tiktoken:NAME`), a file of a kind (a
    tokenizer.json, a SentencePiece .model) or a directory (a saved jaxtrain tokenizer or a
    model directory)."""
    spec = str(spec)
    require_tokenizer_package(spec, what)
    named = next((k for k in _ordered() if k.names(spec)), None)
    if named is not None:
        return named.load_spec(spec, what)
    path = storage.local_copy(spec, what)  # a bucket's file or directory: copied to scratch
    if path.is_dir():
        return _load_directory(path, what)
    if path.is_file():
        return next(k for k in _ordered() if k.holds_file(path)).load_file(path)
    listed = [k.spec for k in KINDS.values()] + ["a model directory"]
    raise DataError(f"{what}={spec}: no such file or directory; give {', '.join(listed[:-1])} "
                    f"or {listed[-1]}")


def kind_of(spec) -> str | None:
    """The kind of tokenizer a spec names, told from its name and a directory's meta file
    without loading it; None when only loading tells (a tokenizer.json, a model directory)."""
    spec = str(spec)
    named = next((k.name for k in _ordered(False) if k.names(spec)), None)
    if named is not None:
        return named
    path = storage.local_copy(spec, "tokenizer")
    if path.is_file():
        return next((k.name for k in _ordered(False) if k.holds_file(path)), None)
    return _directory_kind(path, read_json(path / META_FILE)) if path.is_dir() else None


def require_tokenizer_package(spec, what: str = "--tokenizer") -> None:
    """DataError (one line) when the package that tokenizer `spec` runs on is missing:
    checked before a prepare or a run writes anything, and without importing it."""
    kind = KINDS.get(kind_of(spec))
    if kind is not None and kind.package is not None:
        require_package(kind.package, f"{what}={spec} (a {kind.name} tokenizer)",
                        error=DataError)


def _directory_kind(directory: pathlib.Path, meta: dict) -> str | None:
    kind = meta.get("kind")
    if kind is None:
        kind = next((k.name for k in _ordered(False) if k.in_directory(directory)), None)
    return kind


def _load_directory(directory: pathlib.Path, what: str) -> Tokenizer:
    meta = read_json(directory / META_FILE)
    kind = _directory_kind(directory, meta)
    if kind == NO_TOKENIZER:
        raise DataError(f"{what}={directory}: records that the model has no tokenizer")
    return KINDS.get(kind, _fallback()).load_saved(directory, meta, what)


def load_recorded(directory, recorded: dict, what: str) -> Tokenizer:
    """The tokenizer saved in `directory`, checked to be the one a manifest records
    (`recorded`: its meta, with the fingerprint); DataError (one line) for another one (a
    dataset's tokenizer/ overwritten: its ids would be read as other text)."""
    tokenizer = load_tokenizer(directory, what)
    if tokenizer.fingerprint() != recorded.get("fingerprint"):
        about = (f"{recorded.get('kind')} ({recorded.get('vocab_size')} ids, sha256 "
                 f"{str(recorded.get('fingerprint'))[:12]})")
        raise DataError(f"{what}: {directory} holds the tokenizer {tokenizer.describe()}, but "
                        f"the dataset's manifest records {about}, which made its ids: put "
                        "back the tokenizer/ the prepare wrote, or prepare the data again")
    return tokenizer


def read_meta(directory) -> dict | None:
    """The meta file of a saved tokenizer, or None."""
    path = storage.as_path(directory) / META_FILE
    return json.loads(path.read_text()) if path.is_file() else None
