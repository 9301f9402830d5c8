"""Object storage for `jaxtrain prepare`: inputs copied into a local cache, and a dataset
prepared on local disk, then published under a gs:// or s3:// prefix.

Object stores have no rename, so the last step of a local prepare (OUT.partial replaces OUT)
becomes an upload whose last object is manifest.json, the commit marker: a prefix without it
is not a dataset (jaxtrain.data.dataset), and a reader that sees it sees every shard. All
before the upload is a local prepare, resumable as one, in a staging directory on this
host's scratch disk (storage.scratch_dir); a prepare killed during its upload leaves the
finished dataset there, and the same command uploads it again. An old dataset under the
prefix loses its manifest before anything else of it goes, so no reader ever sees an old
manifest over new shards.

Inputs on object storage are downloaded whole into the cache, each object once while it
stays the same (size and modification time), then read as local files; the manifest names
them by their URLs, so every machine of a `--shard` prepare describes the same inputs.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import sys

from tqdm import tqdm

from jaxtrain import storage
from jaxtrain.data import dataset as fmt
from jaxtrain.errors import DataError, JaxtrainError

# What a prepare (or a merge, or a tokenizer-only prepare) writes under its --out: a prefix
# holding only these is a dataset, or one whose upload was interrupted; anything else is
# someone's other data, never replaced.
_OURS = re.compile(r"(manifest\.json|tokenizer/.+|tokens-\d+\.bin|mask-\d+\.bin|docs-\d+\.npy"
                   r"|shard-\d+\.json|part-\d+-of-\d+/.+|\.write_test_.+"
                   r"|jaxtrain_tokenizer\.json|tokenizer\.(json|model|tiktoken))")


@contextlib.contextmanager
def errors(key: str, value, after: str = ""):
    """Turns an object store's exception into one line: storage.user_error's for what the
    user must fix (credentials, bucket, permission), else the client's first line."""
    try:
        yield
    except JaxtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - each client raises its own
        raise storage.user_error(e, key, value) or DataError(
            f"{key}={value}: {storage.first_line(e)}{after}") from None


def listing(path, key: str) -> dict[str, int]:
    """{name below it: size} of every file under the directory or object under the prefix
    (storage.listing), a failure one line naming `key`."""
    with errors(key, path):
        return storage.listing(path)


def foreign(names) -> str | None:
    """The first of `names` that no prepare writes, or None."""
    return next((n for n in sorted(names) if not _OURS.fullmatch(n)), None)


def check_writable(path, key: str) -> None:
    """A one-line error now, before the prepare, rather than after hours of it
    (storage.check_writable)."""
    with errors(key, path, " (writing a test object)"):
        storage.check_writable(path)


def _bar(total: int, what: str, enabled: bool) -> tqdm:
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def publish(staged: pathlib.Path, target, key: str, progress: bool,
            last: str = fmt.MANIFEST) -> None:
    """Commits the finished directory `staged` to `target`, `last` (the commit marker)
    last (storage.commit_files); a bar of the bytes sent when there is an upload."""
    total, bar = sum(storage.listing(staged).values()), []

    def sent(n: int) -> None:
        if not bar:  # a rename on disk sends nothing: no bar
            bar.append(_bar(total, "upload", progress))
        bar[0].update(n)

    try:
        with errors(key, target, f"; the prepared data stays in {staged}: run the same command "
                    "again to commit it"):
            storage.commit_files(staged, target, last, sent)
    finally:
        for b in bar:
            b.close()


# --- inputs --------------------------------------------------------------------------------

def fetch_inputs(patterns: list[str], progress: bool) -> tuple[list[str], dict[str, str]]:
    """The input patterns with each gs:// or s3:// one (an object, a prefix, or a glob)
    replaced by its copy in the local cache (storage.cached_copy), and {cache folder: the
    URL it stands for}."""
    local, shown = [], {}
    for pattern in patterns:
        with errors("input", pattern):
            copy, stands_for = storage.cached_copy(
                pattern, "input", lambda total: _bar(total, "download", progress))
        local.append(copy)
        shown.update(stands_for)
    return local, shown
