"""The one path layer: every file jaxtrain reads or writes is named by a path from `as_path`.

A local path is a pathlib.Path; `gs://bucket/key` and `s3://bucket/key` are etils.epath
paths (pathlib's interface over fsspec's gcsfs and s3fs), so the code that reads and writes
is the same for both. The clients take their endpoints and credentials the standard way:
`STORAGE_EMULATOR_HOST` or Google's default credentials for gs://, `AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` or `~/.aws` for s3://.

Object stores differ from a disk in three ways the rest of the code relies on this module
for: a whole-object write is atomic (an object appears complete or not at all) but there is
no rename and no append; and a failed request says why in the client's own exception, which
`user_error` turns into the one-line error every command exits 2 with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import tempfile

import fsspec
from etils import epath

from jaxtrain.errors import ConfigError, require_package

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """An object store: the fsspec package that speaks its protocol and the extra that
    installs it."""
    package: str
    extra: str


SCHEMES = {"gs": Scheme("gcsfs", "gcs"), "s3": Scheme("s3fs", "s3")}


def scheme_of(value) -> str | None:
    """'gs' for gs://bucket/key, None for a local path."""
    match = _URL.match(str(value))
    return match.group(1).lower() if match else None


def is_remote(path) -> bool:
    return scheme_of(path) is not None


def check_path(value, key: str) -> None:
    """ConfigError (one line, naming the flag or key) for a URL of a scheme jaxtrain cannot
    use, or one whose client package is not installed. Checked on the text as given
    (pathlib would fold the '//' away), before anything is written."""
    name = scheme_of(value)
    if name is None:
        return
    if name not in SCHEMES:
        valid = ", ".join(f"{s}://" for s in SCHEMES)
        raise ConfigError(f"{key}={value}: {name}:// is not a storage jaxtrain reads or "
                          f"writes; use a local path, {valid}")
    scheme = SCHEMES[name]
    require_package(scheme.package, f"{key}={value}",
                    f"pip install 'jaxtrain[{scheme.extra}]'")


def as_path(value, key: str = "path"):
    """The path object for `value`: pathlib.Path for a local path, an epath.Path for gs://
    and s3:// (checked with check_path first)."""
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{key}={value!r} is not a path")
    if isinstance(value, pathlib.Path):
        return value
    check_path(value, key)
    if is_remote(value):
        return epath.Path(str(value))
    return pathlib.Path(value).expanduser()


def filesystem(path):
    """(fsspec filesystem, the path as that filesystem names it) for the calls epath does
    not offer: conditional creation, range reads, listing with sizes."""
    return fsspec.core.url_to_fs(str(path))


def atomic_write(path, data: bytes | str) -> None:
    """Writes the whole file or nothing, whatever kills the process: on disk a temporary
    file beside it, flushed to the disk and renamed over it; on object storage one upload
    (an object is only ever seen whole)."""
    blob = data.encode() if isinstance(data, str) else data
    if is_remote(path):
        path.write_bytes(blob)
        return
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path, obj, indent: int | None = None) -> None:
    """atomic_write of `obj` as JSON (one line unless `indent`), newline-terminated."""
    atomic_write(path, json.dumps(obj, indent=indent) + "\n")


def scratch_dir(remote, what: str) -> pathlib.Path:
    """A local directory standing in for `remote` on this host (staged checkpoints,
    TensorBoard events, cached data): $JAXTRAIN_SCRATCH, else ~/.cache/jaxtrain, then a
    folder named after the URL's hash and `what`. Local disk only; never shared."""
    root = pathlib.Path(os.environ.get("JAXTRAIN_SCRATCH")
                        or pathlib.Path.home() / ".cache" / "jaxtrain" / "scratch")
    digest = hashlib.sha1(str(remote).encode()).hexdigest()[:12]
    directory = root / f"{digest}-{what}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def user_error(error: BaseException, key: str, value) -> ConfigError | None:
    """The one-line ConfigError for an object-store failure that is the user's to fix
    (credentials, bucket, permission), or None for anything else (a server error, a lost
    connection: retried or reported by the caller)."""
    text = f"{type(error).__name__}: {error}"
    bucket = str(value).split("://", 1)[-1].split("/", 1)[0]
    if "NoCredentials" in text or "credentials" in text.lower() and "not" in text.lower():
        return ConfigError(f"{key}={value}: no credentials for {scheme_of(value)}:// (set "
                           "them up as the client expects: gcloud auth application-default "
                           "login, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws)")
    # Not a bare "403": a lost connection's message may hold a URL with 403 in a name.
    if isinstance(error, PermissionError) or any(
            sign in text for sign in ("AccessDenied", "(403)", "Forbidden")):
        return ConfigError(f"{key}={value}: no permission to write to bucket {bucket}")
    # s3fs says "The specified bucket does not exist" without naming it.
    if "NoSuchBucket" in text or "specified bucket does not exist" in text or (
            isinstance(error, FileNotFoundError) and bucket in str(error)):
        return ConfigError(f"{key}={value}: bucket {bucket} does not exist")
    return None

