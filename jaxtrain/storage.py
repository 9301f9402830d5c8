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

Only this module asks which storage a path is on (`scheme_of`, `is_remote`); the rest of
the package asks it what to do: a local directory for a tool that writes only local files
(`LocalMirror`), a path's one name (`canonical`), a folder's names, a writable or new
folder's check, a write or delete conditional on an object's version, and, for a caller
that keeps a way of its own for each, whether the path is `on_disk`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
import threading

import fsspec
import fsspec.asyn
import fsspec.callbacks
import tensorstore as ts
from etils import epath

from jaxtrain import retry
from jaxtrain.errors import ConfigError, DataError, JaxtrainError, require_package

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """An object store: the fsspec package that speaks its protocol, the extra that
    installs it, and how its client finds credentials."""
    package: str
    extra: str
    credentials: str


SCHEMES = {
    "gs": Scheme("gcsfs", "gcs", "`gcloud auth application-default login`, or "
                 "GOOGLE_APPLICATION_CREDENTIALS naming a service-account key"),
    "s3": Scheme("s3fs", "s3", "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, ~/.aws, or an "
                 "instance role"),
}


def scheme_of(value) -> str | None:
    """'gs' for gs://bucket/key, None for a local path."""
    match = _URL.match(str(value))
    return match.group(1).lower() if match else None


def is_remote(path) -> bool:
    return scheme_of(path) is not None


def on_disk(path) -> bool:
    """Whether `path` is on this host's file system (a local path; a bucket mounted with
    gcsfuse or s3fs is one): open, mmap, stat, append, rename and flock work on it, and a
    write costs nothing. False on an object store (gs://, s3://), which is read by requests
    and written whole objects at a time, each a billed request. For the callers that have a
    way of their own for each (a memmap or range reads, appending or segment objects)."""
    return not is_remote(path)


def canonical(path):
    """The one name of `path`, to key what is kept per path (a scratch folder, a tier):
    a local path absolute, its symbolic links resolved; a bucket's as it is."""
    return path if is_remote(path) else pathlib.Path(path).resolve()


def check_local_path(value, key: str) -> None:
    """ConfigError (one line, naming the flag or key) for a URL where only a local path is
    supported yet (object storage reaches these paths in a later change; taken as a local
    path, gs://b/x would become a folder named 'gs:'). Checked on the text as given, before
    anything is written."""
    name = scheme_of(value)
    if name is not None:
        raise ConfigError(f"{key}={value}: {name}:// paths (object storage, URLs) are not "
                          "supported yet for this path; give a local path (a bucket mounted "
                          "with gcsfuse or s3fs is one)")


def normalized(value) -> str:
    """The URL with its scheme in lower case: a scheme is case-insensitive (RFC 3986 3.1),
    so S3://b/x is s3://b/x, but fsspec and etils know only the lower-case names (a KeyError
    for 'S3://'); one spelling also gives one scratch folder per URL."""
    text = str(value)
    match = _URL.match(text)
    return text if match is None else match.group(1).lower() + text[len(match.group(1)):]


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
        return epath.Path(normalized(value))
    return pathlib.Path(value).expanduser()


def filesystem(path):
    """(fsspec filesystem, the path as that filesystem names it) for the calls epath does
    not offer: conditional creation, range reads, listing with sizes."""
    return fsspec.core.url_to_fs(normalized(path))


def atomic_write(path, data: bytes | str) -> None:
    """Writes the whole file or nothing, whatever kills the process: on disk a temporary
    file beside it, flushed to the disk and renamed over it; on object storage one upload
    (an object is only ever seen whole)."""
    blob = data.encode() if isinstance(data, str) else data
    if is_remote(path):
        put(path, blob)
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


# Checks every remote write makes first (a held lease's `check`: it raises when this run may
# no longer write to its workdir), each with the prefix it guards. Called with the path about
# to be written, and confirm=True to ask the store again at once (a conditional write refused).
_fences: list = []


def add_fence(check, root) -> None:
    _fences.append((f"{normalized(root).rstrip('/')}/", check))


def remove_fence(check) -> None:
    _fences[:] = [(root, c) for root, c in _fences if c != check]


def fence(path, confirm: bool = False) -> None:
    """Every fence's check of a write to `path`, before it is made."""
    for root, check in list(_fences):
        if normalized(path).startswith(root):
            check(path, confirm=confirm)


def fenced(path) -> bool:
    return any(normalized(path).startswith(root) for root, _ in _fences)


def put(path, blob: bytes, mode: str = "overwrite", say=None,
        budget: float | None = None, versioned: bool = True) -> None:
    """One object written whole, under the one retry policy (retry.py): each attempt is
    cut off at what is left of the budget, a transient failure is tried again, and
    retry.Unreachable (one line) ends it. mode="create": only if there is no such object
    (FileExistsError otherwise, not retried). `say`: where a stall is reported. Under a
    fence (a held lease), an overwrite is conditional (VersionedWrites) unless not
    `versioned` (the lease's own object, whose writer judges its versions itself)."""
    fs, name = filesystem(path)
    versioned = versioned and mode == "overwrite" and fenced(path)

    def attempt(timeout: float) -> None:
        fence(path)  # before every attempt: a retry may come after the lease is lost
        if versioned:
            _versions.put(path, blob, timeout)
        else:
            run_async(fs, fs._pipe_file(name, blob, mode=mode), timeout)

    retry.call(attempt, f"writing {path}", say=say, budget=budget)


class VersionedWrites:
    """Fencing the store itself enforces. A fence is asked before an upload, but a process
    paused between that check and the upload (SIGSTOP, a stalled VM) past the takeover time
    would land its write after another run took the lease over. So each overwrite under a
    fence is conditional on the version (S3 ETag, GCS generation) this process last wrote or
    read there (S3 If-Match / If-None-Match: *, GCS ifGenerationMatch, 0 for none): a write
    that comes after another run's is refused by the store. A refusal asks the fence again
    (confirm=True): LeaseLost when the lease was taken over; while it is still ours the
    other version was our own (an attempt cut off after the store took it), and the write
    is made once more on the version read now."""

    def __init__(self):
        self._known: dict[str, str | None] = {}  # path -> version; None: no such object
        self._lock = threading.Lock()

    def put(self, path, blob: bytes, timeout: float) -> None:
        key = normalized(path)
        for last_try in (False, True):
            with self._lock:
                known = key in self._known
                version = self._known.get(key)
            if not known:
                version = _version_of(path, timeout)
            try:
                written = _put_on_version(path, blob, version, timeout)
            except (FileExistsError, OSError) as e:
                if not isinstance(e, FileExistsError) and not precondition_failed(e):
                    raise
                with self._lock:
                    self._known.pop(key, None)
                fence(path, confirm=True)  # LeaseLost when another run took over
                if last_try:
                    raise ConfigError(f"{path}: another writer keeps changing this object "
                                      "while this run holds the lease of its folder") from e
                continue
            with self._lock:
                self._known[key] = written
            return


_versions = VersionedWrites()


def _version_of(path, timeout: float) -> str | None:
    """The object's version now (S3 ETag, GCS generation), or None when there is none."""
    fs, name = filesystem(path)
    fs.invalidate_cache(name)
    try:
        info = run_async(fs, fs._info(name), timeout)
    except FileNotFoundError:
        return None
    version = info.get("ETag") or info.get("generation")
    return str(version) if version else None


def _put_on_version(path, blob: bytes, version: str | None, timeout: float) -> str | None:
    """Writes the object only if its version is still `version` (None: only if there is no
    such object); the version written. The store's refusal as the client raises it:
    FileExistsError, or an OSError that precondition_failed recognises."""
    fs, name = filesystem(path)
    bucket, key = name.split("/", 1)
    try:
        if scheme_of(path) == "s3":
            condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
            reply = run_async(fs, fs._call_s3("put_object", Bucket=bucket, Key=key,
                                              Body=blob, **condition), timeout)
            written = reply.get("ETag")
        else:  # gs: a multipart upload, the one kind the JSON API takes a precondition on
            meta = json.dumps({"name": key})
            body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n"
                    "--==0==\nContent-Type: application/octet-stream\n\n").encode()
            reply = run_async(fs, fs._call(
                "POST", f"{fs._location}/upload/storage/v1/b/{bucket}/o",
                uploadType="multipart", ifGenerationMatch=version or "0",
                headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                data=body + blob + b"\n--==0==--", json_out=True), timeout)
            written = reply.get("generation")
    finally:
        fs.invalidate_cache(name)
    return str(written) if written else None


def conditional_writes(path) -> bool:
    """Whether a write to `path` can be made conditional on the object's version
    (put_if_match: S3 If-Match, GCS ifGenerationMatch); a disk has no versions."""
    return scheme_of(path) in ("s3", "gs")


def put_if_match(path, blob: bytes, version: str, timeout: float) -> bool:
    """Writes the object only if it is still the version `version` (conditional_writes),
    cut off after `timeout` seconds; False when the object changed since."""
    try:
        _put_on_version(path, blob, version, timeout)
    except (FileExistsError, OSError) as e:
        if not isinstance(e, FileExistsError) and not precondition_failed(e):
            raise
        return False
    return True


def delete_if_match(path, version: str | None) -> None:
    """Deletes the object only if it is still the version `version` (S3 If-Match, GCS
    ifGenerationMatch); whatever it is without a version. When it is gone or changed, the
    client's error: FileNotFoundError, FileExistsError (gcsfs: 412), or an OSError that
    precondition_failed recognises (s3fs)."""
    fs, name = filesystem(path)
    bucket, key = name.split("/", 1)
    if scheme_of(path) == "s3" and version:
        fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
    elif scheme_of(path) == "gs" and version:
        fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
    else:
        fs.rm_file(name)


def precondition_failed(error: BaseException) -> bool:
    """S3's 412 (the object changed since) or 409 (a concurrent write won), as s3fs raises
    them: an OSError whose cause holds the S3 error code."""
    text = f"{error} {error.__cause__ or ''}"
    return any(code in text for code in ("PreconditionFailed", "pre-conditions",
                                         "ConditionalRequestConflict"))


def run_async(fs, coroutine, timeout: float):
    """One of an fsspec filesystem's coroutines, run on its loop and cancelled after
    `timeout` seconds (its client's own retries too: gcsfs sleeps up to ~35 s on a lost
    server, s3fs waits 60 s for a read)."""
    return fsspec.asyn.sync(fs.loop, asyncio.wait_for, coroutine, timeout)


def write_json(path, obj, indent: int | None = None, sort_keys: bool = False,
               default=None) -> None:
    """atomic_write of `obj` as JSON (one line unless `indent`), newline-terminated."""
    atomic_write(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default)
                 + "\n")


class _Bytes(fsspec.callbacks.Callback):
    """An fsspec transfer callback that hands each increase of the transferred bytes to
    `update(n)` (a progress bar's), whichever of its calls the client makes."""

    def __init__(self, update):
        super().__init__()
        self.update, self.seen = update, 0

    def call(self, *args, **kwargs) -> None:
        if self.value > self.seen:
            self.update(self.value - self.seen)
            self.seen = self.value


def copy_file(fs, source: str, target: str, upload: bool, progress=None) -> None:
    """fs.put_file (upload) or fs.get_file, reporting bytes to `progress(n)` (all of the
    file's bytes by its end, however finely the client reports)."""
    callback = _Bytes(progress or (lambda n: None))
    # Not cut off by a timeout (a large file takes its time); a failed attempt is tried
    # again whole under the one policy, and the bytes it sent are not counted twice.
    retry.call(lambda _timeout: (fs.put_file if upload else fs.get_file)(
        source, target, callback=callback),
        f"{'uploading' if upload else 'downloading'} {source if not upload else target}")
    size = os.path.getsize(source if upload else target)
    if progress is not None and size > callback.seen:
        progress(size - callback.seen)


def upload_tree(local: pathlib.Path, remote, last: str | None = None, progress=None) -> int:
    """Copies every file under the local directory to the same names under the remote
    prefix, each as one upload (an object is replaced whole), the file named `last` last
    (a marker: whoever sees it sees the rest); returns the number of files. For what is
    staged on a local disk (TensorBoard events, profiles, a saved tokenizer, a prepared
    dataset). `progress(n)` is told each n bytes sent."""
    fs, root = filesystem(remote)
    files = [p for p in sorted(local.rglob("*")) if p.is_file()]
    files.sort(key=lambda p: p.relative_to(local).as_posix() == last)
    for path in files:
        copy_file(fs, str(path), f"{root}/{path.relative_to(local).as_posix()}", True,
                  progress)
    return len(files)


class LocalMirror:
    """A local directory standing for the directory `target`, for a tool that writes only
    local files (TensorBoard's event writer, jax.profiler), `path`: on disk `target` itself;
    on a bucket a folder of this host's scratch (`what` names it; made now), whose files
    sync() uploads to `target`, each whole (a file the tool appended to since replaces its
    object). `staged`: whether there is anything for sync() to do."""

    def __init__(self, target, what: str):
        self.target = target
        self.staged = is_remote(target)
        self.path = scratch_dir(target, what) if self.staged else target

    def sync(self) -> None:
        if self.staged:
            upload_tree(self.path, self.target)


def contained(root, name, what: str, error: type[JaxtrainError] = DataError,
              links: bool = False, where=None):
    """root / name, for a `name` read from a manifest, a listing or a bucket (`what` says
    which), once it is shown to stay inside `root`: a relative path with no '..' part (a
    bucket key may be '../../x' or '/tmp/x'), and on local disk one that does not lead out
    through a symbolic link already there (unless `links`: a Hugging Face cache links its
    files to blobs beside the folder). Else `error`, one line naming the name and where it
    came from (`where`: the folder to name, default `root`). The one check of such names:
    every reader and downloader calls it before it reads or writes anything."""
    parts = name.split("/") if isinstance(name, str) else None
    if not parts or not name or "\0" in name or name.startswith("/") or ".." in parts:
        raise error(f"{what} names {name!r}, which is not a file inside {where or root}: a "
                    "name there must be a relative path without '..'; refused")
    path = root / name
    if not links and not is_remote(root):
        base = pathlib.Path(root).resolve()
        if not pathlib.Path(path).resolve().is_relative_to(base):
            raise error(f"{what} names {name!r}, which leads out of {where or root} (through "
                        f"a symbolic link, to {pathlib.Path(path).resolve()}); refused")
    return path


def download_tree(remote, local: pathlib.Path, what: str | None = None) -> pathlib.Path:
    """Copies every object under the remote prefix into the local directory (created);
    returns it. Every object's name is checked first (`contained`; `what` says whose objects
    they are), so a hostile key writes nothing anywhere."""
    fs, root = filesystem(remote)
    # A key ending in '/' is a folder marker some tools make: it names no file.
    names = [n for n in sorted(fs.find(root)) if not n.endswith("/") and n != root]
    targets = [contained(local, name[len(root):].lstrip("/"),
                         what or f"the listing of {remote}", where=remote) for name in names]
    local.mkdir(parents=True, exist_ok=True)
    for name, target in zip(names, targets):
        target.parent.mkdir(parents=True, exist_ok=True)
        copy_file(fs, name, str(target), False)
    return local


def scratch_dir(remote, what: str) -> pathlib.Path:
    """A local directory standing in for `remote` on this host (staged checkpoints,
    TensorBoard events, cached data): $JAXTRAIN_SCRATCH, else ~/.cache/jaxtrain, then a
    folder named after the URL's hash and `what`. Local disk only; never shared."""
    directory = _scratch_path(remote, what)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _scratch_path(remote, what: str) -> pathlib.Path:
    root = pathlib.Path(os.environ.get("JAXTRAIN_SCRATCH")
                        or pathlib.Path.home() / ".cache" / "jaxtrain" / "scratch")
    digest = hashlib.sha1(str(remote).encode()).hexdigest()[:12]
    return root / f"{digest}-{what}"


def first_line(error: BaseException) -> str:
    """'Kind: the first line of its message', for one-line reports."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


# S3's codes for a key it does not know and for a secret that does not match the key (moto
# answers the same); GCS answers 401 (gcsfs: an HttpError with code 401).
_INVALID_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                        "Invalid Credentials", "invalid_grant")


def _invalid_credentials(error: BaseException, text: str) -> bool:
    for e in (error, error.__cause__):
        if getattr(e, "code", None) == 401:
            return True
    return any(code in text for code in _INVALID_CREDENTIALS)


def _missing_gcs_bucket(error: FileNotFoundError, bucket: str) -> bool:
    """gcsfs names a missing bucket by the request's path: its listing b/BUCKET/o, or an
    upload's .../b/BUCKET/o?name=KEY (a missing object is b/BUCKET/o/KEY)."""
    message = str(error).strip().rstrip("/")
    return re.search(rf"(^|/)b/{re.escape(bucket)}/o(\?.*)?$", message) is not None


def user_error(error: BaseException, key: str, value) -> ConfigError | None:
    """The one-line ConfigError for an object-store failure that is the user's to fix
    (credentials, bucket, permission), or None for anything else (a server error, a lost
    connection: retried or reported by the caller)."""
    # s3fs turns boto's error into a builtin one and keeps the S3 error code (NoSuchBucket,
    # AccessDenied) only in the cause.
    text = f"{type(error).__name__}: {error} {error.__cause__ or ''}"
    bucket = str(value).split("://", 1)[-1].split("/", 1)[0]
    name = scheme_of(value)
    scheme = SCHEMES.get(name)
    # GCS answers an anonymous caller (no credentials found) 401 too.
    anonymous = "NoCredentials" in text or "Anonymous caller" in text
    if not anonymous and _invalid_credentials(error, text):
        return ConfigError(f"{key}={value}: invalid credentials for {name}:// (the server "
                           f"does not accept the key in use: {scheme.credentials})")
    if anonymous or "credentials" in text.lower() and "not" in text.lower():
        return ConfigError(f"{key}={value}: no credentials for {name}:// "
                           f"({scheme.credentials})")
    # Not a bare "403": a lost connection's message may hold a URL with 403 in a name.
    if isinstance(error, PermissionError) or any(
            sign in text for sign in ("AccessDenied", "(403)", "Forbidden")):
        return ConfigError(f"{key}={value}: no permission for bucket {bucket} (the "
                           "credentials in use may not read or write it)")
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower() or (
            isinstance(error, FileNotFoundError) and _missing_gcs_bucket(error, bucket)):
        return ConfigError(f"{key}={value}: bucket {bucket} does not exist")
    return None



# --- committing a directory staged whole on local disk -------------------------------------
# (prepared datasets and their parts, tokenizers, exported models.) "Stage, then write the
# marker last" lives here only. Checkpoints have their own atomic-commit writer, for files
# written in place by many processes; the two share the rule: a reader sees the old artefact
# or the new one, whole.

def staging_dir(target, what: str) -> pathlib.Path:
    """Where an artefact bound for `target` is put together before `commit_files`: beside
    it on disk (TARGET.partial, so that the commit is one rename on the same filesystem);
    for a bucket, a folder of this host's scratch (`what` names it). Not created."""
    if is_remote(target):
        return _scratch_path(target, what)
    target = pathlib.Path(target)
    return target.with_name(target.name + ".partial")


def local_copy(value, key: str, what: str = "copy") -> pathlib.Path:
    """A local path holding what `value` names, a file or a directory, for libraries that
    read only local files (tokenizers, safetensors, transformers): on disk the path itself
    (~ expanded); on a bucket, a copy in this host's scratch (a folder named by `what`) of
    the object, or of every object under the prefix (a path that holds neither is returned
    as it is, for the caller's "no such file")."""
    path = as_path(value, key)
    if not is_remote(value):
        return path
    if path.is_file():
        fs, name = filesystem(value)
        target = scratch_dir(value, what) / path.name
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        copy_file(fs, name, str(tmp), False)
        os.replace(tmp, target)
        return target
    if path.is_dir():
        return download_tree(path, scratch_dir(value, what))
    return path


def make_parent(path) -> None:
    """Makes the folder a file is about to be written into: on disk its parent directories;
    on a bucket nothing (a prefix exists as soon as an object is under it)."""
    if not is_remote(path):
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)


def check_writable(path) -> None:
    """On a bucket, writes and deletes an empty object under the prefix, so that a missing
    permission is found before the work rather than after it. On disk, nothing: the staging
    directory made beside the target is the test."""
    if is_remote(path):
        probe = path / f".write_test_{socket.gethostname()}_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()


def listing(path) -> dict[str, int]:
    """{name below `path`, '/'-separated: size} of every file under a directory or object
    under a prefix ({} when there is none); a bucket is listed afresh, not from the
    client's cache (another machine may have written since)."""
    if not is_remote(path):
        root = pathlib.Path(path)
        return ({p.relative_to(root).as_posix(): p.stat().st_size
                 for p in sorted(root.rglob("*")) if p.is_file()} if root.is_dir() else {})
    fs, root = filesystem(path)
    fs.invalidate_cache()
    found = fs.find(root, detail=True)
    names = {name[len(root):].lstrip("/"): info.get("size", 0) for name, info in found.items()}
    return {name: size for name, size in names.items() if name and not name.endswith("/")}


def names(directory) -> list[str]:
    """The names directly in a local directory or under a prefix, hidden ones included
    ([] when there is none); a bucket is listed afresh."""
    if not is_remote(directory):
        directory = pathlib.Path(directory)
        return [p.name for p in directory.iterdir()] if directory.is_dir() else []
    fs, root = filesystem(directory)
    fs.invalidate_cache(root)
    try:
        return [str(n).rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []


def require_writable(directory, key: str) -> None:
    """Creates the local directory and writes (and deletes) a probe file in it, or in the
    prefix on object storage; ConfigError (one line, naming `key`) when it cannot: the
    disk's reason, or the object store's (credentials, bucket, permission)."""
    probe = directory / f".write_test_{socket.gethostname()}_{os.getpid()}"
    if is_remote(directory):
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except Exception as e:  # noqa: BLE001 - each client raises its own
            raise user_error(e, key, directory) or ConfigError(
                f"{key}={directory} cannot be written: {first_line(e)}") from None
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={directory} is not writable: {e.strerror}") from None


def new_folder_contents(directory, key: str) -> list[str]:
    """What a folder that is to be filled anew holds (its names; on a bucket every object's
    under the prefix), once it is shown to be one this process can fill: ConfigError (one
    line, naming `key`) for a file, a folder this user cannot create files in, or a bucket
    that cannot be written or listed. Checked before any work; nothing is left behind."""
    if is_remote(directory):
        require_writable(directory, key)
        fs, root = filesystem(directory)
        fs.invalidate_cache(root)
        try:
            held = fs.find(root, maxdepth=None)
        except Exception as e:  # noqa: BLE001 - each client raises its own
            raise user_error(e, key, directory) or ConfigError(
                f"{key}={directory} cannot be listed: {first_line(e)}") from None
        return [str(n).rstrip("/").rsplit("/", 1)[-1] for n in held]
    directory = pathlib.Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{key}={directory} is a file; give a new or empty directory")
    held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    parent = next(p for p in (directory, *directory.parents) if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={directory} is not writable: {parent} does not let "
                          "this user create files")
    return held


def commit_files(staged: pathlib.Path, target, marker: str, progress=None) -> None:
    """Puts the finished local directory `staged` (holding `marker`) at `target`, so that a
    reader of `target` sees the previous artefact or this one whole, never a mix; `staged`
    is gone after. On disk: one rename (a previous `target` is moved aside first and deleted
    only once the new one is in place). On a bucket, which has no rename: the previous
    marker is deleted first, then the objects this upload does not replace, then every file
    is uploaded with `marker` last: who sees the marker sees the rest. A commit killed on a
    bucket leaves `staged` whole, so calling this again finishes it. `progress(n)` is told
    each n bytes sent."""
    if not is_remote(target):
        target = pathlib.Path(target)
        old = None
        if target.exists():
            old = target.with_name(f"{target.name}.old-{os.getpid()}")
            os.replace(target, old)
        os.replace(staged, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    fs, root = filesystem(target)
    ours, old = listing(staged), listing(target)
    if marker in old:
        fs.rm_file(f"{root}/{marker}")
    stale = [f"{root}/{name}" for name in old if name not in ours and name != marker]
    if stale:
        fs.rm(stale)
    upload_tree(staged, target, last=marker, progress=progress)
    shutil.rmtree(staged, ignore_errors=True)


# --- a local copy of inputs on a bucket ----------------------------------------------------

def cached_copy(pattern: str, key: str, bar) -> tuple[str, dict[str, str]]:
    """(a local pattern standing for `pattern`, {cache folder: the URL it stands for}): a
    local path or glob as it is; a gs:// or s3:// object, prefix or glob copied whole into
    this host's cache (each object downloaded unless its copy there has its size and
    modification time; a copy of an object no longer there goes), for readers that read
    local files. `bar(total bytes)` makes a context manager whose update(n) is told the
    bytes downloaded; `key` names the input in errors."""
    if not is_remote(pattern):
        return pattern, {}
    check_path(pattern, key)
    base, fs, objects = _objects(pattern, key)
    files = scratch_dir(pattern, "input") / "files"
    for name in objects:  # a key may hold '../': refused before anything is written
        contained(files, name, f"{key} {pattern}", where=base)
    _sync(fs, objects, files, bar)
    rest = pattern.rstrip("/")[len(base):].lstrip("/")
    return (str(files / rest) if rest else str(files)), {str(files): base}


def _objects(pattern: str, key: str):
    """(the URL the input's names are relative to, its filesystem, {name below it: (object,
    info)})."""
    scheme = scheme_of(pattern)
    fs, path = filesystem(pattern)
    path = path.rstrip("/")
    fs.invalidate_cache()
    if glob.has_magic(path):
        parts = path.split("/")
        base = "/".join(parts[:next(k for k, p in enumerate(parts) if glob.has_magic(p))])
        found = fs.glob(path, detail=True)
    elif fs.isfile(path):
        base, found = path.rsplit("/", 1)[0], {path: fs.info(path)}
    else:
        base, found = path, fs.find(path, detail=True)
    found = {name: info for name, info in found.items() if info.get("type") != "directory"}
    if not found:
        raise DataError(f"{key} {pattern}: no such object, or no object matches it")
    return (f"{scheme}://{base}", fs,
            {name[len(base):].lstrip("/"): (name, info) for name, info in found.items()})


def _mtime_ns(info: dict) -> int | None:
    """The object's modification time (S3 LastModified, GCS updated), in whole
    microseconds as nanoseconds: what the cached copy's mtime is set to."""
    when = info.get("LastModified") or info.get("mtime")
    return None if when is None else round(when.timestamp() * 1e6) * 1000


def _sync(fs, objects: dict[str, tuple[str, dict]], files: pathlib.Path, bar) -> None:
    """Makes `files` hold exactly the objects: each downloaded unless its copy there has
    its size and modification time; files of objects no longer there go."""
    for path in [p for p in files.rglob("*") if p.is_file()] if files.exists() else []:
        if path.relative_to(files).as_posix() not in objects:
            path.unlink()
    todo = []
    for name, (obj, info) in sorted(objects.items()):
        target, mtime = files / name, _mtime_ns(info)
        if not (mtime is not None and target.is_file() and target.stat().st_size ==
                info.get("size") and target.stat().st_mtime_ns == mtime):
            todo.append((name, obj, mtime, info.get("size") or 0))
    if not todo:
        return
    # Outside `files` (a killed download is never an input), and one per process: the parts
    # of a --shard prepare on one machine share the cache.
    tmp = files.parent / f"download-{os.getpid()}.tmp"
    with bar(sum(size for *_, size in todo)) as shown:
        for name, obj, mtime, _ in todo:
            target = files / name
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_file(fs, obj, str(tmp), False, shown.update)
            os.replace(tmp, target)
            if mtime is not None:
                os.utime(target, ns=(mtime, mtime))
# tensorstore: the key-value stores that checkpoints write and read in place (gcs, s3, file).

_GCS_SET: set[str] = set()  # the TENSORSTORE_GCS_HTTP_URL values kvstore_spec has set


def kvstore_spec(path) -> dict:
    """tensorstore's kvstore spec for a directory (its keys are names under it): `file` on
    disk, `gcs` and `s3` on a bucket, reaching the same servers the fsspec clients do.
    tensorstore's gcs driver reads TENSORSTORE_GCS_HTTP_URL, not STORAGE_EMULATOR_HOST, and
    its s3 driver takes the endpoint as an option, not from AWS_ENDPOINT_URL; both are set
    here from the standard variables, so one environment points every client at one server."""
    text = normalized(path).rstrip("/")
    name = scheme_of(text)
    if name is None:
        return {"driver": "file", "path": str(pathlib.Path(text).absolute()) + "/"}
    bucket, _, key = text.split("://", 1)[1].partition("/")
    prefix = key + "/" if key else ""
    if name == "gs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        # Set from it unless the user set it (a value set here follows the emulator's).
        if emulator and os.environ.get("TENSORSTORE_GCS_HTTP_URL") in (None, "", *_GCS_SET):
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = emulator
            _GCS_SET.add(emulator)
        return {"driver": "gcs", "bucket": bucket, "path": prefix}
    spec = {"driver": "s3", "bucket": bucket, "path": prefix}
    if endpoint := os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        spec["endpoint"] = endpoint
    if region := os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        # Else the default chain, which also reads ~/.aws (and says so when it is absent).
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def kvstore(path):
    """An open tensorstore KvStore over the directory `path` (kvstore_spec)."""
    return ts.KvStore.open(kvstore_spec(path)).result()


def settled(start, what: str, key: str = "checkpoints", value=None):
    """start() -> a tensorstore future; its result under the one retry policy (retry.py):
    an attempt is cut off (and cancelled: no write lands after it was given up) at what is
    left of the budget, a transient failure is tried again, retry.Unreachable ends it; a
    refusal that is the user's to fix is its one-line ConfigError (`key`=`value`)."""
    def attempt(timeout: float):
        future = start()
        try:
            return future.result(timeout=timeout)
        except BaseException:
            future.cancel()
            raise
    return retry.call(attempt, what, user_error=lambda e: user_error(e, key, value or what))


def kv_keys(path) -> list[str]:
    """Every key under the directory `path` of a kvstore (names relative to it), listed
    afresh under the retry policy; a missing bucket is its one-line ConfigError."""
    store = kvstore(path)
    try:
        keys = settled(store.list, f"listing {path}", value=path)
    except ValueError as e:  # gcs answers a listing of a missing bucket 404, and only then
        if is_remote(path) and str(e).startswith("NOT_FOUND"):
            bucket = str(path).split("://", 1)[1].split("/", 1)[0]
            raise ConfigError(f"checkpoints={path}: bucket {bucket} does not exist") from e
        raise
    if not keys and is_remote(path):  # fake-gcs-server lists a missing bucket as empty
        fs, root = filesystem(path)
        fs.invalidate_cache()
        try:
            fs.find(root, maxdepth=1)
        except FileNotFoundError as e:
            if (mine := user_error(e, "checkpoints", path)) is not None:
                raise mine from e
    return sorted(k.decode() for k in keys)


class AtomicSet:
    """The one writer of a set of files that appears whole or not at all, under `path`.

    On disk the files go into `path.partial/`, which commit() renames to `path` (a rename is
    atomic); on a bucket, where nothing renames, they go straight under `path/`, and commit()
    writes the marker object last (an object appears whole): a reader lists a set as written
    only once its marker is there (`committed`). Several processes may write into one set;
    one of them commits it, after all have finished (the caller's barrier). The marker's
    contents are the caller's (a manifest); it is written in both cases."""

    MARKER = "commit.json"

    def __init__(self, path):
        self.path = normalized(path).rstrip("/")
        self.remote = is_remote(self.path)
        self.writing = self.path if self.remote else self.path + ".partial"
        self.store = kvstore(self.writing)

    def write(self, name: str, data: bytes) -> None:
        """One file of the set, whole, under the retry policy (and the lease's fence)."""
        fence(f"{self.path}/{name}")
        settled(lambda: self.store.write(name, data), f"writing {self.path}/{name}",
                value=self.path)

    def commit(self, marker: bytes) -> None:
        self.write(self.MARKER, marker)
        if not self.remote:
            os.replace(self.writing, self.path)

    @classmethod
    def rewrite_marker(cls, path, marker: bytes) -> None:
        """Replaces a committed set's marker (one object, written whole: a reader sees the
        old one or the new one)."""
        fence(f"{path}/{cls.MARKER}")
        store = kvstore(path)
        settled(lambda: store.write(cls.MARKER, marker), f"writing {path}/{cls.MARKER}",
                value=path)

    @classmethod
    def delete(cls, path) -> None:
        """Deletes a set: its marker first (from then on it is no set, whatever kills
        this), then its other files; on disk its directory."""
        if not is_remote(path):
            shutil.rmtree(str(path), ignore_errors=True)
            return
        fence(f"{path}/{cls.MARKER}")
        store = kvstore(path)
        settled(lambda: store.write(cls.MARKER, None), f"deleting {path}", value=path)
        for name in kv_keys(path):
            settled(lambda name=name: store.write(name, None), f"deleting {path}/{name}",
                    value=path)

    @classmethod
    def committed(cls, path) -> bytes | None:
        """The marker of a committed set (its manifest), or None: not (wholly) written."""
        store = kvstore(path)
        result = settled(lambda: store.read(cls.MARKER), f"reading {path}/{cls.MARKER}",
                         value=path)
        return result.value if result.state == "value" else None

    @classmethod
    def move(cls, path, target) -> None:
        """Moves a set from `path` to `target`, whole. On disk one rename; on a bucket, where
        nothing renames, every object is copied, the marker last, then the original is
        deleted, its marker first (`delete`): a kill before the copy's marker leaves the set
        where it was (moved again by the next try), never a set in neither place."""
        if not is_remote(path):
            destination = pathlib.Path(str(target))
            destination.parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(str(path)).rename(destination)
            return
        source, dest = kvstore(path), kvstore(target)
        names = [k.decode() for k in source.list().result() if k.decode() != cls.MARKER]
        for name in names:
            dest.write(name, source.read(name).result().value).result()
        marker = source.read(cls.MARKER).result()
        if marker.state == "value":
            dest.write(cls.MARKER, marker.value).result()
        cls.delete(path)
