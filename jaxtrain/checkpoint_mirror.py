"""Checkpoints on object storage: staged on local disk, mirrored to the bucket.

Why staged. orbax 0.12.8 builds tensorstore specs for gs:// only
(`tensorstore_utils._use_gcs_driver`; an s3:// directory fails with "Checkpoint path should
be absolute"), and it commits a step by renaming the step's temporary directory, which an
object store cannot do. So a remote `Checkpoints` directory is staged: orbax writes and reads
a local directory, `storage.scratch_dir(URL, "checkpoints")`, with its own tmp-dir commit,
unchanged; once a step is committed there and its local manifest exists, this module copies
it to the bucket on Checkpoints' background thread, in this order:

    URL/<step>/...                              every file of the step, first
    URL/../checkpoint_manifests/<step>.json     its manifest, LAST

The manifest object is the commit marker (an object appears whole or not at all): a step
whose manifest object exists was uploaded completely; a step without one is an upload that
did not finish, is never listed, and is deleted by the primary process when a run starts.
A kill at each stage leaves:
  - before any upload: the step on this host's disk only; a run on this host lists it and
    uploads it at start; a run on another host does not see it;
  - some or all files, no manifest: not listed anywhere; deleted at the next start;
  - the manifest written: a committed step, listed and restorable on any host.
Deleting (rotation, setting a damaged step aside) goes the other way: manifest first, then
the files, so a kill in between leaves an incomplete upload, deleted at the next start.

Requests: a checkpoint costs one PUT per file plus one for the manifest (objects under
5 MiB on GCS and 100 MiB on S3; larger ones are resumable or multipart uploads of 50 MiB
pieces: one more request to start, and one per piece), and one more PUT when a health mark
rewrites its manifest. A start lists the directory and the manifests (one request per 1,000
objects each) and reads each manifest; restoring a step this host lacks reads its files.

Retries: a lost connection, a timeout or a server error is retried with exponential backoff
(1, 2, 4, ... 30 s apart) for up to `JAXTRAIN_CHECKPOINT_RETRY_S` seconds (default 120, plus
one second per MiB being moved); errors that are the user's to fix (credentials, a missing
bucket, no permission: `storage.user_error`) are raised at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import time

import fsspec.asyn
import jax

# jax exposes no public handle on the coordination service's key-value store (orbax reaches
# it the same way, orbax/checkpoint/_src/multihost).
from jax._src import distributed

from jaxtrain import retry, storage
from jaxtrain.errors import CheckpointError

RETRY_ENV = "JAXTRAIN_CHECKPOINT_RETRY_S"
_CONCURRENCY = 8  # objects in flight at once in one transfer
_MIN_RATE = 1 << 20  # bytes/s: an attempt may take this long per byte on top of the budget


class Unreachable(CheckpointError):
    """The object store did not answer within the retry budget (`reason`: its last error)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


# The one classifier of transient and permanent errors (retry.py), shared by every transfer.
_transient = retry.transient


def _steps(paths, prefix: str, suffix: str = "") -> set[int]:
    """The step numbers of `prefix/<step><suffix>...` among listed object paths."""
    found = set()
    for path in paths:
        head = path[len(prefix):].lstrip("/").split("/")[0]
        if head.endswith(suffix) and head[:len(head) - len(suffix)].isdigit():
            found.add(int(head[:len(head) - len(suffix)]))
    return found


class Mirror:
    """The bucket's side of a staged checkpoint directory: listing, uploads, downloads and
    deletes of whole steps, each request retried as the module docstring says. Blocking;
    Checkpoints calls the writes on its background thread."""

    def __init__(self, directory, manifests):
        self.url = str(directory)
        self.fs, self.root = storage.filesystem(directory)
        self.manifests = storage.filesystem(manifests)[1]
        self.budget_s = float(os.environ.get(RETRY_ENV) or 120)
        self.puts = 0  # objects written: what checkpoints cost in write requests

    def _step_key(self, step: int) -> str:
        return f"{self.root}/{step}"

    def _manifest_key(self, step: int) -> str:
        return f"{self.manifests}/{step}.json"

    # Reading

    def listing(self) -> tuple[set[int], set[int]]:
        """(steps with a manifest: committed, steps with any object: committed or not)."""
        self.fs.invalidate_cache()  # another host may have written since
        try:
            objects = self._call("list", "_find", self.root)
            manifests = self._call("list", "_find", self.manifests)
        except FileNotFoundError as e:  # a prefix that does not exist lists as empty
            raise storage.user_error(e, "checkpoints", self.url) or CheckpointError(
                f"checkpoints={self.url} cannot be listed ({storage.first_line(e)})") from e
        return _steps(manifests, self.manifests, ".json"), _steps(objects, self.root)

    def manifest(self, step: int) -> bytes | None:
        """The manifest object of `step` (None: there is none)."""
        try:
            return self._call(f"reading the manifest of step {step}", "_cat_file",
                              self._manifest_key(step))
        except FileNotFoundError:
            return None

    def download(self, step: int, files: dict, target: pathlib.Path) -> None:
        """The files of `step` ({relative name: [size, digest]}) into `target`. Raises
        FileNotFoundError with the URL of an object that is missing; CheckpointError, before
        anything is written, for a name that would land outside `target`."""
        what = f"checkpoints={self.url}: the manifest of step {step}"
        paths = {name: storage.contained(target, name, what, CheckpointError,
                                         where=f"{self.url}/{step}") for name in sorted(files)}
        pairs = []
        for name, path in paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            pairs.append((f"{self._step_key(step)}/{name}", str(path)))
        try:
            self._each(f"download of step {step}", "_get_file", pairs,
                       sum(size for size, _ in files.values()))
        except FileNotFoundError as e:
            name = str(e.args[0] if e.args else "")[len(self._step_key(step)) + 1:]
            raise FileNotFoundError(f"{self.url}/{step}/{name}") from e

    # Writing

    def upload(self, step: int, root: pathlib.Path, manifest: bytes, files: dict) -> None:
        """Every file of the local step `root`, then its manifest: the commit marker."""
        self.put_files(step, root, files)
        self.put_manifest(step, manifest)

    def put_files(self, step: int, root: pathlib.Path, files: dict) -> None:
        storage.fence(self.url + "/")  # this run may still write here (its lease)
        pairs = [(str(root / name), f"{self._step_key(step)}/{name}") for name in sorted(files)]
        self._each(f"upload of step {step}", "_put_file", pairs,
                   sum(size for size, _ in files.values()))
        self.puts += len(pairs)

    def put_manifest(self, step: int, manifest: bytes) -> None:
        storage.fence(self.url + "/")
        self._call(f"upload of the manifest of step {step}", "_pipe_file",
                   self._manifest_key(step), manifest)
        self.puts += 1

    def delete(self, step: int) -> None:
        """Uncommits `step` (its manifest), then deletes its files."""
        for key, method in ((self._manifest_key(step), "_rm_file"),
                            (self._step_key(step), "_rm")):
            try:
                self._call(f"delete of step {step}", method, key,
                           *((True,) if method == "_rm" else ()))
            except FileNotFoundError:
                pass
        self.fs.invalidate_cache()

    def set_aside(self, step: int, aside) -> None:
        """Copies the objects of `step` under `aside` (a URL), then deletes the step."""
        self.fs.invalidate_cache()
        source = self._step_key(step)
        objects = self._call(f"listing step {step}", "_find", source)
        target = storage.filesystem(aside)[1]
        self._each(f"copy of step {step} to {aside}", "_cp_file",
                   [(path, target + path[len(source):]) for path in objects], 0)
        self.delete(step)

    # Retries

    def _run(self, coroutine, timeout: float):
        """Runs one of the filesystem's coroutines on fsspec's loop, cancelled (its own
        retries too: gcsfs sleeps up to ~35 s on a lost server) after `timeout` seconds."""
        return fsspec.asyn.sync(self.fs.loop, asyncio.wait_for, coroutine, timeout)

    def _call(self, what: str, method: str, *args):
        return self._retrying(what, lambda timeout: self._run(
            getattr(self.fs, method)(*args), timeout), 0)

    def _each(self, what: str, method: str, pairs: list[tuple[str, str]], size: int) -> None:
        """method(a, b) for every pair, _CONCURRENCY at a time; a retry repeats only the
        pairs not done yet. A missing source raises FileNotFoundError(source)."""
        todo = list(pairs)

        async def run_all(current: list, done: set):
            limit = asyncio.Semaphore(_CONCURRENCY)

            async def one(pair):
                async with limit:
                    await getattr(self.fs, method)(*pair)
                done.add(pair)
            return await asyncio.gather(*map(one, current), return_exceptions=True)

        def attempt(timeout: float) -> None:
            current, done = list(todo), set()
            try:
                results = self._run(run_all(current, done), timeout)
            finally:
                todo[:] = [pair for pair in current if pair not in done]
            failed = [(pair, r) for pair, r in zip(current, results) if isinstance(r, Exception)]
            if failed:
                pair, error = next(((p, e) for p, e in failed if not _transient(e)), failed[0])
                if isinstance(error, FileNotFoundError):
                    raise FileNotFoundError(pair[0]) from error
                raise error

        if todo:
            self._retrying(what, attempt, size)

    def _retrying(self, what: str, attempt, size: int):
        """attempt(timeout) until it returns. On a transient error it sleeps 1, 2, 4, ...
        30 s and tries again while the budget lasts, then raises Unreachable; a user error
        raises its one-line ConfigError; FileNotFoundError is the caller's to judge."""
        deadline = time.monotonic() + self.budget_s + size / _MIN_RATE
        delay = 1.0
        while True:
            try:
                return attempt(max(deadline - time.monotonic(), 1.0))
            except FileNotFoundError:
                raise
            except Exception as e:
                if (user := storage.user_error(e, "checkpoints", self.url)) is not None:
                    raise user from e
                if not _transient(e):
                    raise
                if time.monotonic() + delay > deadline:
                    raise Unreachable(
                        f"checkpoints={self.url}: {what} failed ({storage.first_line(e)}); retried "
                        f"for {self.budget_s:g} s", storage.first_line(e)) from e
                time.sleep(delay)
                delay = min(2 * delay, 30.0)


class HostParts:
    """A job of several processes with no shared disk (each stages its own part of every
    step: the shards it wrote, see checkpoint.py) agrees here, through jax.distributed's
    key-value store, on who uploads which file and when a step is whole in the bucket:

      1. every process publishes the list of its files of the step;
      2. a file is uploaded by the lowest-ranked process that holds it (files every process
         writes, such as orbax's metadata, go up once, from process 0);
      3. each process says when its part is uploaded; process 0 waits for all of them, then
         writes the manifest of the whole step (every owner's files): the commit marker.

    A process that dies or runs out of retries before step 3 leaves the step without a
    manifest, so uncommitted, as for one process."""

    def __init__(self, url: str, timeout_s: float):
        self.client = distributed.global_state.client
        self.url, self.timeout_ms = url, int(timeout_s * 1000)
        self.index, self.count = jax.process_index(), jax.process_count()
        self.rounds: dict[int, int] = {}  # uploads of each step so far (a step set aside
        # is saved again: its next upload is agreed under fresh keys)

    def _key(self, step: int, what: str, process: int) -> str:
        return f"jaxtrain/checkpoints/{self.url}/{step}/{self.rounds.get(step, 0)}/{what}/{process}"

    def _get(self, step: int, what: str, process: int) -> str:
        try:
            return self.client.blocking_key_value_get(self._key(step, what, process),
                                                      self.timeout_ms)
        except Exception as e:  # a peer that died, or never finished its part
            raise Unreachable(
                f"checkpoints={self.url}: process {process} did not {what} its part of step "
                f"{step} within {self.timeout_ms // 1000} s", storage.first_line(e)) from e

    def owned(self, step: int, files: dict) -> dict:
        """Publishes this process's files of `step`; returns those it is to upload."""
        self.client.key_value_set(self._key(step, "list", self.index), json.dumps(files))
        held = set()
        for process in range(self.index):
            held |= set(json.loads(self._get(step, "list", process)))
        return {name: entry for name, entry in files.items() if name not in held}

    def uploaded(self, step: int, files: dict) -> dict | None:
        """Says this process's part of `step` is in the bucket. Process 0 waits for every
        part and returns the files of the whole step (each from its owner); others None."""
        self.client.key_value_set(self._key(step, "upload", self.index), "1")
        whole = None
        if self.index == 0:
            whole = dict(files)
            for process in range(1, self.count):
                self._get(step, "upload", process)
                for name, entry in json.loads(self._get(step, "list", process)).items():
                    whole.setdefault(name, entry)
        return whole

    def finish(self, step: int) -> None:
        """This try at `step` is over, uploaded or not: the next one uses fresh keys."""
        self.rounds[step] = self.rounds.get(step, 0) + 1
