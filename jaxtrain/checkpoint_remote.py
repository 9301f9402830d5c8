"""The remote tier of Checkpoints: a gs:// or s3:// directory written and read in place
through the shard store (jaxtrain/checkpoint_shards.py), with nothing of a step on the
host's disk.

    DIR/<step>/state.p<i>.<k>.bin   process i's shards (checkpoint_shards says the layout)
    DIR/<step>/state.p<i>.json      process i's index, with an xxh3 per piece
    DIR/<step>/commit.json          the marker, last: the config, the fingerprints (`sums`)
                                    and the health mark, rewritten whole when it changes

A save copies this process's shards to host memory on the training thread (what orbax's
async save does too), then writes them on a background thread; process 0 writes the marker
once every process has written its part, so a step is committed whole or not at all, and a
kill at any stage leaves either a committed step or objects without a marker, which are
never listed and are deleted by the next run's process 0. A restore reads on each process
only the pieces its devices need, checks each against its xxh3, and combines the processes'
verdicts: a damaged step is set aside whole (`<DIR>_damaged/<step>-<time>`, never deleted)
on every process together, and the next older one is tried. Every request is under the one
retry policy (retry.py); a store lost past its budget is a one-line error at a restore, and
a logged line at a save (the run goes on; the step is not committed). The run's last save is
the exception (in a one-process job): there is no later step to save instead, so it is tried
again until the store answers, up to $JAXTRAIN_STORAGE_FINAL_S (outbox.py), saying so.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import time
from collections.abc import Callable

import jax
from jax.experimental import multihost_utils

from jaxtrain import checkpoint_shards, retry, storage
from jaxtrain.checkpoint_tier import Checkpoints
from jaxtrain.errors import CheckpointError, JaxtrainError, LeaseUnconfirmed
from jaxtrain.fingerprints import tree_bits, tree_sums
from jaxtrain.outbox import FINAL_ENV, FINAL_S, retry_pause_s

_uses: collections.Counter = collections.Counter()  # coordination keys: one name per use


def _why(error: BaseException) -> str:
    """An Unreachable's reason, or the first line of a lease that held the write back."""
    return getattr(error, "reason", None) or storage.first_line(error)


def _tag(kind: str, url: str, step: int) -> str:
    """A name for one save or restore of `step`, the same on every process (they make the
    same calls in the same order) and never used twice in a job."""
    _uses[kind, url, step] += 1
    return f"{kind}/{url}/{step}/{_uses[kind, url, step]}"


class RemoteCheckpoints(Checkpoints, where="remote"):
    """Checkpoints' remote tier (module docstring)."""

    def __init__(self, directory, keep: int, keep_period: int = 0,
                 log: Callable[[str], None] = print, manifests=None,
                 on_commit: Callable[[int], None] | None = None, read_only: bool = False):
        del manifests  # each step's marker is its manifest, in the step
        super().__init__(keep, keep_period, log, on_commit, read_only)
        self.directory, self.url = directory, storage.normalized(directory).rstrip("/")
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "jaxtrain-checkpoints")
        self._pending: list[concurrent.futures.Future] = []
        self._failure: JaxtrainError | None = None
        self.markers = self._scan()
        self.healthy = {s for s, m in self.markers.items() if m.get("healthy")}

    def _path(self, step: int) -> str:
        return f"{self.url}/{step}"

    def _scan(self) -> dict[int, dict]:
        """{step: marker} of the committed steps; process 0 of a run deletes the objects of
        steps whose save did not finish (no marker)."""
        objects: dict[int, set[str]] = {}
        for key in storage.kv_keys(self.url):
            head, _, name = key.partition("/")
            if head.isdigit():
                objects.setdefault(int(head), set()).add(name)
        markers = {}
        for step, names in sorted(objects.items()):
            if storage.AtomicSet.MARKER in names:
                if (found := checkpoint_shards.marker(self._path(step))) is not None:
                    markers[step] = found
            elif self.primary and all(n.startswith("state.p") for n in names):
                storage.AtomicSet.delete(self._path(step))
                self.log(f"jaxtrain: deleted checkpoint step {step} from {self.directory}: "
                         "its save did not finish (no commit marker)")
        return markers

    def steps(self) -> list[int]:
        return sorted(self.markers)

    # Saving

    def save(self, step: int, tree: dict, config: dict, last: bool = False) -> None:
        """Starts a save: the shards and the fingerprints are copied to the host before
        this returns, and written on the background thread. `last`: the run's final save,
        patient with a store that does not answer (module docstring)."""
        self._raise_failure()
        sums = {"sum_of_squares": tree_sums(tree), "bit_sums": tree_bits(tree)}
        host = checkpoint_shards.host_copy(tree)
        tag = _tag("save", self.url, step)
        # Patience only where no other process must try again in step with this one.
        patient_s = retry.env_number(FINAL_ENV, FINAL_S) \
            if last and jax.process_count() == 1 else None
        self._pending.append(self._executor.submit(
            self._write, step, host, {"config": config, "sums": sums}, tag, patient_s))

    def _write(self, step: int, host, marker: dict, tag: str,
               patient_s: float | None = None) -> None:
        problem = None
        marker = {**marker, "healthy": step in self.healthy}
        deadline = time.monotonic() + (patient_s or 0.0)
        watching = retry.watch(f"saving checkpoint step {step} to {self.directory}", self.log,
                               going_on=lambda: f"waiting up to {patient_s:g}s (${FINAL_ENV})")
        with watching if patient_s else contextlib.nullcontext():
            while True:
                try:
                    problem = self._write_once(step, host, marker, tag)
                except (retry.Unreachable, LeaseUnconfirmed) as e:
                    # Unconfirmed: the lease held the write back while the store was away.
                    problem = _why(e)
                    if time.monotonic() < deadline:
                        time.sleep(retry_pause_s())
                        tag = _tag("save", self.url, step)
                        continue
                except JaxtrainError as e:
                    self._failure = e  # raised by the next save or wait
                    return
                break
        if problem is not None:
            self.log(f"jaxtrain: checkpoint step {step} could not be saved to "
                     f"{self.directory}: {problem}; the run goes on without it")
            return
        self.markers[step] = {"format": checkpoint_shards.FORMAT,
                              "processes": jax.process_count(), **marker}
        if self.on_commit is not None:
            self.on_commit(step)

    def _write_once(self, step: int, host, marker: dict, tag: str) -> str | None:
        """What went wrong with one try of a save (None: committed)."""
        try:
            return checkpoint_shards.write(self._path(step), host, marker, tag)
        except (retry.Unreachable, LeaseUnconfirmed, JaxtrainError):
            raise
        except Exception as e:  # noqa: BLE001 - an answer not foreseen: the run goes on
            return storage.first_line(e)

    def wait(self) -> None:
        """Blocks until every started save is committed (or has failed, said in a line)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        self._raise_failure()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def vouch(self, step: int) -> None:
        """Nothing to do: every piece has its checksum from the moment it is written."""

    # Health and rotation

    def _record_health(self, step: int) -> None:
        """Rewrites the step's marker with the mark (process 0, on the background thread
        after the step's save)."""
        if self.primary:
            self._pending.append(self._executor.submit(self._write_health, step))

    def _write_health(self, step: int) -> None:
        marker = self.markers.get(step)
        if marker is None or marker.get("healthy"):
            return  # not committed (a save that failed), or committed with the mark
        marker = {**marker, "healthy": True}
        try:
            storage.AtomicSet.rewrite_marker(self._path(step), json.dumps(marker).encode())
        except (retry.Unreachable, LeaseUnconfirmed) as e:
            self.log(f"jaxtrain: the health mark of checkpoint step {step} could not be "
                     f"written to {self.directory}: {_why(e)}")
            return
        except JaxtrainError as e:
            self._failure = e
            return
        self.markers[step] = marker

    def _delete(self, step: int) -> None:
        """Forgets a step rotated out; process 0 deletes it, on the background thread after
        any save in flight."""
        self.markers.pop(step, None)
        if self.primary:
            self._pending.append(self._executor.submit(self._delete_objects, step))

    def _delete_objects(self, step: int) -> None:
        try:
            storage.AtomicSet.delete(self._path(step))
        except (retry.Unreachable, LeaseUnconfirmed) as e:
            self.log(f"jaxtrain: checkpoint step {step} could not be deleted from "
                     f"{self.directory}: {_why(e)}; a later run deletes it")
        except JaxtrainError as e:
            self._failure = e

    # Restoring

    def _read(self, step: int, verify: bool, target: dict, check_config):
        """(restored tree, saved config, saved sums, None) or (.., what is wrong), the
        verdict the same on every process. Every piece read is checked whatever `verify`
        (its checksum costs less than its transfer)."""
        saved = self.markers[step].get("config")
        try:
            mismatch = self.mismatch(step, target)
        except CheckpointError as e:
            if isinstance(e.__cause__, retry.Unreachable):
                raise
            problem = storage.first_line(e)
        except ValueError as e:  # an index that is no JSON
            problem = storage.first_line(e)
        else:
            check_config(step, saved, mismatch)
            tree, problem = self._restore(step, target)
            return tree, saved, self.markers[step].get("sums"), problem
        return None, saved, None, checkpoint_shards.combined(
            problem, _tag("index", self.url, step))

    def _restore(self, step: int, target: dict):
        try:
            return checkpoint_shards.restore(self._path(step), target,
                                             _tag("restore", self.url, step))
        except retry.Unreachable as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} could not be "
                                  f"read: {e}") from e

    def restore(self, step: int, target: dict) -> dict:
        """Restores into `target`'s shapes and shardings (any mesh)."""
        tree, problem = self._restore(step, target)
        if problem is not None:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: "
                                  f"{problem}")
        return tree

    def restore_items(self, step: int, target: dict) -> dict:
        """Only the top-level entries of the saved tree that `target` names."""
        return self.restore(step, target)

    def restore_config(self, step: int) -> dict:
        return self.markers[step]["config"]

    def restore_sums(self, step: int) -> dict | None:
        return self.markers[step].get("sums")

    def latest_intact(self) -> tuple[int, dict]:
        """(step, saved config) of the newest committed checkpoint."""
        if not self.markers:
            raise CheckpointError(f"no intact checkpoint in {self.directory}")
        step = max(self.markers)
        return step, self.restore_config(step)

    def signature(self, step: int) -> dict[tuple, tuple]:
        try:
            return checkpoint_shards.signature(self._path(step))
        except retry.Unreachable as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} could not be "
                                  f"read: {e}") from e

    def set_aside(self, step: int):
        """Moves a damaged step whole into <dir>_damaged/<step>-<time> (process 0; the
        others wait for it), kept for inspection. Returns where it went."""
        aside = f"{self.url.rsplit('/', 1)[0]}/{self.url.rsplit('/', 1)[1]}_damaged/" \
                f"{step}-{int(time.time())}"
        if self.primary:
            checkpoint_shards.set_aside(self._path(step), aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxtrain_set_aside_{self.url}_{step}")
        self.markers.pop(step, None)
        self.healthy.discard(step)
        return aside

