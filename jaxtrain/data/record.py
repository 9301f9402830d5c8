"""Every run knows what it trained on: data fingerprints and the tokenizer, kept in the workdir.

At its first step a run writes WORKDIR/data.json (a fingerprint of every data source: the
built-in corpus with the Python that supplied it, .bin files, prepared datasets, mixture
weights, the validation split) and WORKDIR/tokenizer/ (the tokenizer that made the ids). A
resume compares: data that changed is refused in one line naming what changed, unless
`data.allow_changed=True` (then the change is appended to the record's history); a
tokenizer that changed is always refused, since the ids would mean other text. A run whose
ids have no known tokenizer (a Hugging Face import without tokenizer files) records that
too, so that no default stands in for it; its first training data's tokenizer replaces it.
"""

from __future__ import annotations

import json
import pathlib

from jaxtrain import storage
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.data.sources import SOURCES
from jaxtrain.errors import DataError
from jaxtrain.workdir import RECORD_FILE, TOKENIZER_DIR


def data_tokenizer(c) -> tokenizers_lib.Tokenizer | None:
    """The tokenizer that made the ids the run trains on; None when unknown (synthetic, or a
    .bin without data.tokenizer)."""
    make = SOURCES[c.data.source].tokenizer
    return None if make is None else make(c)


def run_data(c) -> tuple[dict, tokenizers_lib.Tokenizer | None]:
    """(fingerprints of the config's data, its tokenizer), for check_and_store; DataError
    when the tokenizer's vocabulary does not fit model.vocab_size."""
    tokenizer = data_tokenizer(c)
    if tokenizer is not None and tokenizer.vocab_size > c.model.vocab_size:
        raise DataError(f"the data's tokenizer ({tokenizer.describe()}) has "
                        f"{tokenizer.vocab_size} ids, more than model.vocab_size="
                        f"{c.model.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}")
    return SOURCES[c.data.source].fingerprints(c), tokenizer


def _changes(before: dict, now: dict) -> list[str]:
    lines = []
    for key in list(before) + [k for k in now if k not in before]:
        old, new = before.get(key), now.get(key)
        if (old or {}).get("fingerprint") != (new or {}).get("fingerprint"):
            lines.append(f"{key} was {old['about'] if old else 'absent'}, now "
                         f"{new['about'] if new else 'absent'}")
    return lines


def check_and_store(workdir, items: dict, tokenizer: tokenizers_lib.Tokenizer | None,
                    resumed: bool, allow_changed: bool, write: bool) -> None:
    """Refuses a resume whose data or tokenizer changed (DataError, one line); writes the
    record and the tokenizer into the workdir (when `write`: process 0)."""
    workdir = storage.as_path(workdir, "--workdir")
    path = workdir / RECORD_FILE
    saved = json.loads(path.read_text()) if path.is_file() else None
    saved_tokenizer = _saved_meta(workdir)
    if resumed and tokenizer is not None and saved_tokenizer is not None \
            and saved_tokenizer["fingerprint"] != tokenizer.fingerprint():
        raise DataError(f"the data was made with tokenizer {tokenizer.describe()}, but this "
                        f"run started with {_describe_meta(saved_tokenizer)} "
                        f"({workdir / TOKENIZER_DIR}); its ids would mean other text: "
                        "prepare the data with the run's tokenizer, or use another --workdir")
    history = []
    if resumed and saved is not None:
        changes = _changes(saved["items"], items)
        if changes and not allow_changed:
            more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
            raise DataError(f"the data changed since this run started: {changes[0]}{more}; "
                            "set data.allow_changed=True to resume on the new data anyway")
        history = saved.get("history", []) + ([{"changes": changes}] if changes else [])
        if not changes:
            return _store_tokenizer(workdir, tokenizer, saved_tokenizer, write)
    if write:
        _write_json(path, {"items": items, "history": history,
                           "tokenizer": tokenizer.meta() if tokenizer else None})
    _store_tokenizer(workdir, tokenizer, saved_tokenizer if resumed else None, write)


def _saved_meta(workdir: pathlib.Path) -> dict | None:
    """The meta file of the run's tokenizer; None also where it records that there is none."""
    meta = tokenizers_lib.read_meta(workdir / TOKENIZER_DIR)
    return None if meta is None or meta.get("kind") == tokenizers_lib.NO_TOKENIZER else meta


def _store_tokenizer(workdir: pathlib.Path, tokenizer, saved_meta, write: bool) -> None:
    if write and tokenizer is not None and saved_meta is None:
        tokenizer.save(workdir / TOKENIZER_DIR)


def _describe_meta(meta: dict) -> str:
    if meta["kind"] == "bytes":
        return "bytes (UTF-8, 256 ids)"
    return f"{meta['kind']} tokenizer ({meta['vocab_size']} ids, sha256 {meta['fingerprint'][:12]})"


def _write_json(path: pathlib.Path, value: dict) -> None:
    storage.write_json(path, value, indent=2, sort_keys=True)


def run_tokenizer(workdir, cfg) -> tokenizers_lib.Tokenizer | None:
    """The tokenizer a run's ids belong to: WORKDIR/tokenizer (None where it records that
    there is none), or for runs made before it was stored, bytes when the run trained on the
    built-in corpus; None when unknown."""
    directory = storage.as_path(workdir, "--workdir") / TOKENIZER_DIR
    meta = tokenizers_lib.read_meta(directory)
    if meta is not None:
        if meta.get("kind") == tokenizers_lib.NO_TOKENIZER:
            return None
        # the libraries read local files: a bucket's are copied to scratch first
        local = storage.local_copy(directory, "--workdir", "tokenizer")
        return tokenizers_lib.load_tokenizer(local, "the run's tokenizer")
    if SOURCES[cfg.data.source].byte_level:
        return tokenizers_lib.ByteTokenizer()
    return None


def store_tokenizer(workdir, tokenizer: tokenizers_lib.Tokenizer | None,
                    extra: dict[str, str] | None = None) -> None:
    """Puts a tokenizer into a workdir (convert --from-hf: the model directory's; quantize:
    the run's), with `extra` files beside it (the model's chat template). None records that
    the ids have no known tokenizer, so that run_tokenizer does not fall back to bytes for a
    config on the byte corpus."""
    directory = storage.as_path(workdir, "--workdir") / TOKENIZER_DIR
    if tokenizer is not None:
        tokenizer.save(directory, extra)
        return
    storage.make_parent(directory / tokenizers_lib.META_FILE)
    _write_json(directory / tokenizers_lib.META_FILE, {"kind": tokenizers_lib.NO_TOKENIZER})
