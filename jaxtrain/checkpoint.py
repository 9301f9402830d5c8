"""Orbax checkpoints of a pytree of arrays and the run's config: async, atomic, checksummed.

orbax writes each step to a temporary directory and renames it when complete, so a
half-written step is never listed (and leftover temporary directories are removed when a
run starts). Once a step is committed, a manifest records every file with its size and an
xxh3 checksum, computed on a background thread, never the training thread. A restore checks
the newest step's files against its manifest and falls back to the next older one when a
file is missing, truncated or changed; a damaged step is moved to `<dir>_damaged/`, never
deleted. A checkpoint whose tree does not fit what the run expects is a config error, not
damage: nothing is moved. A step committed without a manifest (a crash between the commit
and the checksums) gets one only once the run has checked the state it restored from it
(train/restore_check.py, then `vouch`): its bytes had nothing to be checked against.

Each step also records, in a small item of its own (`sums`), every floating leaf's sum of
squares as computed on the devices before the save: a fingerprint of the contents that a
restore checks the arrays it read against, with or without a manifest, and on any mesh.

Rotation is ours, not orbax's: `keep` counts only checkpoints known to be healthy (the run
was training normally at or after that step: finite loss, no skipped step), so a checkpoint
of a broken state never pushes the last good one out.

A directory on object storage (gs://, s3://) is staged: orbax writes and reads a local
directory and each committed step is mirrored to the bucket, its manifest object last as the
commit marker (jaxtrain/checkpoint_mirror.py says why and how). Its steps are those on this
host's disk and those in the bucket with a manifest; a step only in the bucket is downloaded
and checked against its manifest before orbax restores it.

A job of several processes with no shared disk (a remote directory, process_count > 1)
stages per host: every process is a primary of its own scratch copy (orbax's
`primary_host=None`) and writes there only its shards, in zarr's one-file-per-chunk layout
(OCDBT would merge the processes' files on process 0, which cannot see them); the bucket
receives each process's files and, once all are there, one manifest of the whole step
(checkpoint_mirror.HostParts). A host's part is not restorable on its own: every restore
downloads the whole step from the bucket.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from etils import epath
from jax.experimental import multihost_utils

from jaxtrain import storage
from jaxtrain.checkpoint_mirror import HostParts, Mirror, Unreachable
from jaxtrain.errors import CheckpointError, JaxtrainError

# Re-exported: the fingerprints were defined here before they had a module of their own.
from jaxtrain.fingerprints import file_checksum, tree_bits, tree_signature, tree_sums
from jaxtrain.rotation import HealthyRotation

__all__ = ["CheckpointError", "Checkpoints", "file_checksum", "tree_bits",
           "tree_signature", "tree_sums"]

_COMMIT_WAIT_S = 120.0  # for orbax's rename after its post-finalization callback


@contextlib.contextmanager
def _quiet(read_only: bool):
    """Orbax warns that a read-only manager's directory "is read only": true and meant, and
    it would turn generate's and eval's one-line errors into five lines."""
    if not read_only:
        yield
        return
    before = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(before)


class Checkpoints:
    """One directory of checkpoints (a tier) with its manifests beside it."""

    def __init__(self, directory, keep: int, keep_period: int = 0,
                 log: Callable[[str], None] = print, manifests=None,
                 on_commit: Callable[[int], None] | None = None, read_only: bool = False):
        """directory: a local path, or a gs:// or s3:// epath.Path (staged, see the module
        docstring). on_commit(step) is called (on a background thread) once a step is on
        disk with its manifest (in the bucket, for a remote directory). read_only: for
        reading a run that may be training right now (eval, generate, export): nothing is
        created, cleaned up or deleted (a remote one downloads what it restores into a
        cache of its own)."""
        self.on_commit = on_commit
        self.keep, self.keep_period, self.log = keep, keep_period, log
        self.rotation = HealthyRotation(keep, keep_period)
        # Process 0 writes manifests and moves damaged steps; a reader writes nothing.
        self.primary = jax.process_index() == 0 and not read_only
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "jaxtrain-manifest")
        self._lock = threading.Lock()
        self.mirror: Mirror | None = None
        self.parts: HostParts | None = None  # several processes, each with its own part
        self._remote: set[int] = set()  # steps in the bucket with their manifest
        self._remote_manifests: dict[int, dict] = {}
        self._unuploaded: set[int] = set()  # committed here, not yet sent to the bucket
        self._failed: set[int] = set()  # their upload ran out of retries: the next save's
        self._failure: JaxtrainError | None = None  # a user error met on the background thread
        if storage.is_remote(directory):
            self._stage(directory, manifests, read_only)
        else:
            self.directory = pathlib.Path(directory).absolute()
            self.staging = self.directory  # where orbax writes
            self.manifests = pathlib.Path(
                manifests or self.directory.parent / "checkpoint_manifests").absolute()
        per_host = self.parts is not None
        options = ocp.CheckpointManagerOptions(
            # A reader's options are the ones orbax would force for read_only anyway, so it
            # has nothing to warn about on the one-line error paths of generate/eval.
            max_to_keep=None, create=not read_only, read_only=read_only,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=True, cleanup_tmp_directories=not read_only,
            enable_background_delete=True,
            async_options=ocp.options.AsyncOptions(
                post_finalization_callback=self._committed_async),
            **({"multiprocessing_options": _EVERY_HOST} if per_host else {}))
        with _quiet(read_only):
            self.manager = ocp.CheckpointManager(
                self.staging, options=options,
                **({"handler_registry": _per_host_handlers()} if per_host
                   else {"item_names": ("state", "config", "sums")}))
        self.healthy = {s for s in self.steps() if self._manifest(s).get("healthy")}
        self._manifested = set(self.steps())  # committed before this run
        if self._unuploaded:
            self._executor.submit(self._upload_pending)

    def _stage(self, directory, manifests, read_only: bool) -> None:
        """Sets up a remote directory: the bucket's committed steps, incomplete uploads
        deleted, this host's staged copies reconciled with the bucket."""
        self.directory = directory
        self.mirror = Mirror(directory, manifests or directory.parent / "checkpoint_manifests")
        # A reader (eval, generate on the training host) caches apart from the run.
        tag = "-read" if read_only else ""
        if jax.process_count() > 1:  # each process its own scratch, even on one machine
            self.parts = HostParts(str(directory), self.mirror.budget_s + 300)
            _quiet_per_host_warnings()
            tag += f".process{jax.process_index()}"
        self.staging = storage.scratch_dir(directory, "checkpoints" + tag)
        self.manifests = storage.scratch_dir(directory, "checkpoint_manifests" + tag)
        self._downloads = storage.scratch_dir(directory, "checkpoint_downloads" + tag)
        self._remote, present = self.mirror.listing()
        if self.primary:  # the run holds the workdir: nobody else uses its staging
            for name in os.listdir(self._downloads):  # left by a kill during a download
                shutil.rmtree(self._downloads / name, ignore_errors=True)
            for step in sorted(present - self._remote):
                self.mirror.delete(step)
                self.log(f"jaxtrain: deleted checkpoint step {step} from {directory}: its "
                         "upload did not finish (no manifest)")
        for name in os.listdir(self.staging):
            if not name.isdigit():
                continue
            step = int(name)
            if self.parts is not None:
                # A part of a step (or a downloaded copy): whatever it is, the bucket has
                # the whole step or nothing of use; a part never uploaded cannot be
                # completed (the other parts' hosts moved on).
                shutil.rmtree(self.staging / name)
                self._forget_local(step)
            elif self._uploaded_path(step).exists() and step not in self._remote:
                # Uploaded once, deleted from the bucket since (rotated, set aside, moved
                # away): this copy is of nothing.
                shutil.rmtree(self.staging / name)
                self._forget_local(step)
            elif step not in self._remote and self._manifest_path(step).exists():
                self._unuploaded.add(step)  # committed here, never uploaded

    def steps(self) -> list[int]:
        return sorted(set(self.manager.all_steps()) | self._remote)

    # Saving

    def save(self, step: int, tree: dict, config: dict) -> None:
        """Starts an async save of a pytree of arrays (the train state's tree()), the run's
        config and the tree's sums of squares (the device-to-host copy happens before this
        returns)."""
        self._raise_failure()
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(tree), config=ocp.args.JsonSave(config),
            sums=ocp.args.JsonSave({"sum_of_squares": tree_sums(tree),
                                    "bit_sums": tree_bits(tree)})), force=True)

    def wait(self) -> None:
        """Blocks until every started save is committed and has its manifest (and, for a
        remote directory, is uploaded or has run out of retries)."""
        self.manager.wait_until_finished()
        self._executor.submit(self._write_manifests).result()
        self._raise_failure()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        self.manager.close()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _committed_async(self) -> None:
        """orbax's post-finalization callback, on its thread just before it renames the
        step's temporary directory to its final name: checksums on ours, once renamed; and
        another try for uploads that ran out of retries before."""
        self._executor.submit(self._write_manifests, _COMMIT_WAIT_S, True)

    def _write_manifests(self, wait_s: float = 0.0, retry_failed: bool = False) -> None:
        deadline = time.monotonic() + wait_s
        with self._lock:
            for step in sorted(self.manager.all_steps()):
                if step in self._manifested:
                    continue
                root = self.staging / str(step)
                while not root.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                if not root.exists():
                    continue  # not renamed yet: the next call writes it
                if (self.primary or self.parts) and not self._manifest_path(step).exists():
                    self.manifests.mkdir(parents=True, exist_ok=True)
                    files = {str(p.relative_to(root)): [p.stat().st_size, file_checksum(p)]
                             for p in sorted(root.rglob("*")) if p.is_file()}
                    self._write_manifest(step, {"format": 2, "files": files,
                                                "healthy": step in self.healthy})
                self._manifested.add(step)
                if self.mirror is not None:
                    self._unuploaded.add(step)  # durable once uploaded
                elif self.on_commit is not None:
                    self.on_commit(step)
        self._upload_pending(retry_failed)  # outside the lock: it may retry for minutes

    def vouch(self, step: int) -> None:
        """The run has checked the state it restored from `step` (train/restore_check.py):
        if the step was committed without a manifest (a crash between orbax's commit and our
        checksums), it gets one now, off the training thread. Never before that check: its
        bytes had nothing to be checked against, and a manifest would vouch for damage (nor
        for a run refused for its config, which writes nothing)."""
        if self.primary and not self._manifest_path(step).exists():
            with self._lock:
                self._manifested.discard(step)
            self._executor.submit(self._write_manifests)

    def _write_manifest(self, step: int, manifest: dict) -> None:
        storage.write_json(self._manifest_path(step), manifest, indent=0)

    # The bucket (a remote directory only), on the background thread

    def _upload_pending(self, retry_failed: bool = False) -> None:
        """Uploads every step committed here and not yet in the bucket, oldest first. One
        that runs out of retries is said in one line and tried again after the next save."""
        if self.mirror is None or not (self.primary or self.parts) or self._failure is not None:
            return
        if retry_failed:
            self._unuploaded |= self._failed
            self._failed.clear()
        for step in sorted(self._unuploaded):
            self._unuploaded.discard(step)
            try:
                self._upload(step)
            except Unreachable as e:
                self._not_uploaded(step, e.reason)
            except JaxtrainError as e:
                self._failure = e  # raised by the next save or wait
                return
            except Exception as e:  # noqa: BLE001 - an answer not foreseen: the run goes on
                self._not_uploaded(step, storage.first_line(e))

    def _not_uploaded(self, step: int, reason: str) -> None:
        self._failed.add(step)
        self.log(f"jaxtrain: checkpoint step {step} could not be uploaded to {self.directory}: "
                 f"{reason}; the run goes on, step {step} stays local only")

    def _upload(self, step: int) -> None:
        if step not in self.manager.all_steps():
            return  # rotated or set aside since it was committed
        manifest = self._manifest_path(step).read_bytes()
        try:
            if self.parts is not None:
                manifest = self._upload_part(step, json.loads(manifest))
            else:
                self.mirror.upload(step, self.staging / str(step), manifest,
                                   json.loads(manifest)["files"])
        except FileNotFoundError as e:
            if step not in self.manager.all_steps():
                return  # rotated while it was being uploaded; its delete comes next
            raise storage.user_error(e, "checkpoints", self.directory) or CheckpointError(
                f"checkpoint step {step} could not be uploaded to {self.directory}: "
                f"{storage.first_line(e)}") from e
        self._uploaded_path(step).touch()
        self._remote.add(step)
        if manifest is not None:
            self._remote_manifests[step] = json.loads(manifest)
        if self.on_commit is not None:
            self.on_commit(step)

    def _upload_part(self, step: int, part: dict) -> bytes | None:
        """This process's part of `step` (its `part` manifest); process 0 then writes the
        whole step's manifest and returns it. HostParts says the order."""
        try:
            files = self.parts.owned(step, part["files"])
            self.mirror.put_files(step, self.staging / str(step), files)
            whole = self.parts.uploaded(step, part["files"])
            if whole is None:
                return None
            manifest = json.dumps({**part, "files": whole, "whole": True}, indent=0).encode()
            self.mirror.put_manifest(step, manifest)
            return manifest
        finally:
            self.parts.finish(step)

    def _delete_remote(self, step: int) -> None:
        try:
            self.mirror.delete(step)
        except Unreachable as e:
            self.log(f"jaxtrain: checkpoint step {step} could not be deleted from "
                     f"{self.directory}: {e.reason}; a later rotation deletes it")
        except JaxtrainError as e:
            self._failure = e
        self._remote.discard(step)
        self._remote_manifests.pop(step, None)

    # Health and rotation

    def mark_healthy(self, step: int) -> None:
        """Training was healthy at or after `step`: it counts toward `keep` from now on."""
        if step in self.healthy:
            return
        self.healthy.add(step)
        self._executor.submit(self._record_health, step)
        self.rotate()

    def _record_health(self, step: int) -> None:
        """Persists the mark (a step not yet committed gets it with its manifest; one in
        the bucket gets its manifest object rewritten)."""
        with self._lock:
            manifest = _read_manifest(self._manifest_path(step))
            if not (self.primary and manifest and not manifest.get("healthy")):
                return
            self._write_manifest(step, {**manifest, "healthy": True})
            self._remote_manifests.pop(step, None)
        if self.mirror is None or step not in self._remote:
            return  # its upload, still to come, takes the new manifest
        try:
            self.mirror.put_manifest(step, self._manifest_path(step).read_bytes())
        except Unreachable as e:
            self.log(f"jaxtrain: the health mark of checkpoint step {step} could not be "
                     f"written to {self.directory}: {e.reason}")
        except JaxtrainError as e:
            self._failure = e

    def rotate(self) -> None:
        """Deletes healthy checkpoints older than the newest `keep` healthy ones (but every
        keep_period-th step); unhealthy ones never count, and are deleted only once older
        than a kept healthy one."""
        # From the health marks, which every process of a job sets at the same step (the
        # deletes below synchronise the processes), not from the committed steps, whose
        # newest one a process may see before another does.
        local = set(self.manager.all_steps())
        for step in self.rotation.doomed(self.steps(), self.healthy):
            if step in local:
                self.manager.delete(step)
            self.healthy.discard(step)
            if self.primary or self.parts:  # a per-host process keeps its own records
                self._forget_local(step)
                self._remote.discard(step)
            if self.primary and self.mirror is not None:  # after an upload in flight, if any
                self._executor.submit(self._delete_remote, step)

    # Restoring

    def newest_intact(self, target: dict, check_config: Callable[[int, dict, str | None], None],
                      verify: bool = True, above: int = -1):
        """(step, restored tree, saved config, saved sums or None) of the newest intact
        checkpoint newer than `above`, or None. Damaged steps are reported, set aside and
        skipped. check_config(step, saved config, how the saved tree differs from `target`
        or None) raises ConfigError for a checkpoint this run cannot continue."""
        for step in reversed([s for s in self.steps() if s > above]):
            # A step only in the bucket is downloaded, and so checked, whatever `verify`.
            problem = (self.verify(step, checksums=verify)
                       if verify or self._remote_only(step) else None)
            saved = sums = None
            if problem is None:
                try:
                    saved, sums = self.restore_config(step), self.restore_sums(step)
                except Exception as e:  # noqa: BLE001 - any failure to read is damage
                    problem = f"its config cannot be read ({storage.first_line(e)})"
            if problem is None:
                check_config(step, saved, self.mismatch(step, target))
                try:
                    restored = self.restore(step, target)
                except Exception as e:  # noqa: BLE001 - see below
                    if verify and self._checksummed(step):
                        # Every byte is as written: the failure is not the checkpoint's
                        # (memory, I/O, a bug), so it stays where it is.
                        raise CheckpointError(
                            f"checkpoint step {step} in {self.directory} passed its checksums "
                            f"but could not be restored ({storage.first_line(e)}); nothing was "
                            "moved") from e
                    problem = f"it cannot be restored ({storage.first_line(e)})"
                else:
                    return step, restored, saved, sums
            self.set_aside_damaged(step, problem)
        return None

    def set_aside_damaged(self, step: int, problem: str) -> None:
        """Sets a damaged step aside (`problem` says how it is damaged) and says so."""
        moved = self.set_aside(step)
        self.log(f"jaxtrain: checkpoint step {step} in {self.directory} is damaged: "
                 f"{problem}; moved to {moved}, falling back to the previous one")

    def mismatch(self, step: int, target: dict) -> str | None:
        """How the saved tree differs from `target` ('lacks opt_state/...'), None if not."""
        saved, wanted = self.signature(step), tree_signature(target)
        if saved == wanted:
            return None
        missing = sorted(set(wanted) - set(saved))
        extra = sorted(set(saved) - set(wanted))
        reshaped = sorted(p for p in set(saved) & set(wanted) if saved[p] != wanted[p])
        parts = [f"{label} {'/'.join(paths[0])}" + (f" (+{len(paths) - 1} more)"
                                                     if len(paths) > 1 else "")
                 for label, paths in (("lacks", missing), ("has an extra", extra),
                                      ("differs in shape or dtype at", reshaped)) if paths]
        return "; ".join(parts)

    def restore(self, step: int, target: dict) -> dict:
        """Restores into `target`'s shapes and shardings (a pytree of ShapeDtypeStructs with
        shardings: any mesh, orbax reshards)."""
        self._local(step)
        return self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target))).state

    def signature(self, step: int) -> dict[tuple, tuple]:
        """tree_signature of a step's saved tree, read from its metadata (nothing restored)."""
        return tree_signature(_state_handler(self.parts is not None).metadata(
            epath.Path(self._local(step) / "state")))

    def restore_params(self, step: int, target_params: dict) -> dict:
        """Only the parameters of a step (no optimizer state), into `target_params`' shapes
        and shardings: what generation, evaluation and export read."""
        return self.restore_items(step, {"params": target_params})["params"]

    def restore_items(self, step: int, target: dict) -> dict:
        """Only the top-level entries of the saved tree that `target` names (e.g. params and
        a LoRA run's base_fingerprint), into its shapes and shardings."""
        self._local(step)
        return self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))).state

    def latest_intact(self) -> tuple[int, dict]:
        """(step, saved config) of the newest checkpoint whose files are all there."""
        for step in reversed(self.steps()):
            if self.verify(step, checksums=False) is None:
                return step, self.restore_config(step)
        raise CheckpointError(f"no intact checkpoint in {self.directory}")

    def restore_config(self, step: int) -> dict:
        self._local(step)
        return self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore())).config

    def restore_sums(self, step: int) -> dict | None:
        """The fingerprints recorded when `step` was saved: {"sum_of_squares": tree_sums,
        "bit_sums": tree_bits (absent before they were recorded)}; None: saved before
        either was."""
        if not (self._local(step) / "sums").exists():
            return None
        return dict(self.manager.restore(step, args=ocp.args.Composite(
            sums=ocp.args.JsonRestore())).sums)

    def set_aside(self, step: int):
        """Moves a damaged step out of orbax's sight (so that the resumed run can save that
        step again) into <dir>_damaged/, keeping it for inspection (for a remote directory:
        copied there in the bucket, then deleted; a step never uploaded moves on local
        disk). Returns where it went."""
        stamp = int(time.time())
        aside = self.directory.parent / f"{self.directory.name}_damaged" / f"{step}-{stamp}"
        if self.mirror is not None:
            aside = self._set_aside_staged(step, aside, stamp)
        elif self.primary:
            aside.parent.mkdir(parents=True, exist_ok=True)
            (self.directory / str(step)).rename(aside)
            self._manifest_path(step).unlink(missing_ok=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxtrain_set_aside_{step}")
        self.manager.reload()
        self.healthy.discard(step)
        self._manifested.discard(step)  # the run saves this step again: a new manifest
        return aside

    def _set_aside_staged(self, step: int, aside, stamp: int):
        if not self.primary:
            if self.parts is not None:  # a copy (or part) of what process 0 sets aside
                shutil.rmtree(self.staging / str(step), ignore_errors=True)
                self._forget_local(step)
            return aside
        local = self.staging / str(step)
        if step in self._remote:
            # On the background thread, after any upload or delete in flight.
            self._executor.submit(self.mirror.set_aside, step, aside).result()
            shutil.rmtree(local, ignore_errors=True)  # a copy of what was set aside
        else:  # never uploaded: this copy is the only one
            aside = storage.scratch_dir(self.directory, "checkpoints_damaged") / \
                f"{step}-{stamp}"
            if local.exists():
                local.rename(aside)
        self._remote.discard(step)
        self._remote_manifests.pop(step, None)
        self._forget_local(step)
        return aside

    # Staged copies of a remote directory's steps

    def _remote_only(self, step: int) -> bool:
        """Restored from the bucket: only there, or here only as this host's part."""
        return self.mirror is not None and (
            step not in self.manager.all_steps()
            or (self.parts is not None
                and not _read_manifest(self._manifest_path(step)).get("whole")))

    def _local(self, step: int) -> pathlib.Path:
        """The directory orbax reads `step` from, downloaded first if only in the bucket."""
        if self._remote_only(step):
            if problem := self._download(step, checksums=False):
                raise CheckpointError(f"checkpoint step {step} in {self.directory} is "
                                      f"damaged: {problem}")
        return self.staging / str(step)

    def _download(self, step: int, checksums: bool) -> str | None:
        """Downloads a step only in the bucket into the staging directory, once its files
        match their manifest; else what is wrong with them. A lost server raises
        Unreachable (a CheckpointError): nothing is judged damaged for it."""
        files = self._remote_manifest(step).get("files")
        shown = self.directory / str(step)
        if not files:
            return f"its manifest {self.mirror.manifests}/{step}.json cannot be read"
        target = self._downloads / f"{step}-{os.getpid()}"  # readers may share the cache
        shutil.rmtree(target, ignore_errors=True)
        try:
            self.mirror.download(step, files, target)
        except FileNotFoundError as e:
            shutil.rmtree(target, ignore_errors=True)
            return f"{e} is missing"
        if problem := _files_problem(target, files, checksums, shown):
            shutil.rmtree(target, ignore_errors=True)
            return problem
        self._write_manifest(step, self._remote_manifest(step))  # as uploaded, health too
        self._uploaded_path(step).touch()
        if self.parts is not None:  # this host's part, replaced by the whole step
            shutil.rmtree(self.staging / str(step), ignore_errors=True)
        try:
            os.replace(target, self.staging / str(step))
        except OSError:  # another reader on this host has put it there first
            shutil.rmtree(target, ignore_errors=True)
        self.manager.reload()
        self._manifested.add(step)
        return None

    def _remote_manifest(self, step: int) -> dict:
        if step not in self._remote_manifests:
            data = self.mirror.manifest(step)
            try:
                self._remote_manifests[step] = json.loads(data) if data else {}
            except ValueError:
                self._remote_manifests[step] = {}
        return self._remote_manifests[step]

    def _uploaded_path(self, step: int) -> pathlib.Path:
        """Marks a staged step as once in the bucket (its absence there then means it was
        deleted there, not that it still has to be uploaded)."""
        return self.manifests / f"{step}.uploaded"

    def _forget_local(self, step: int) -> None:
        self._manifest_path(step).unlink(missing_ok=True)
        if self.mirror is not None:
            self._uploaded_path(step).unlink(missing_ok=True)

    # Manifests: relative path -> [size, xxh3] of every file of a committed step.

    def _manifest_path(self, step: int) -> pathlib.Path:
        return self.manifests / f"{step}.json"

    def _manifest(self, step: int) -> dict:
        manifest = _read_manifest(self._manifest_path(step))
        if not manifest and step in self._remote and self._remote_only(step):
            return self._remote_manifest(step)
        return manifest

    def _checksummed(self, step: int) -> bool:
        files = self._manifest(step).get("files", {})
        return bool(files) and all(digest for _, digest in files.values())

    def verify(self, step: int, checksums: bool = True) -> str | None:
        """What is wrong with a step's files (None: nothing, or no manifest yet: orbax's
        atomic commit vouches for it). A remote directory's step is checked on this host's
        copy, downloaded if there is none; a bad copy of a step in the bucket is replaced
        by the bucket's before the step is judged."""
        if self._remote_only(step):
            return self._download(step, checksums)
        problem = _files_problem(self.staging / str(step),
                                 self._manifest(step).get("files", {}), checksums)
        if problem and self.mirror is not None and step in self._remote:
            shutil.rmtree(self.staging / str(step))
            self._forget_local(step)
            self.manager.reload()
            return self._download(step, checksums)
        return problem


# Several processes, each the primary of its own scratch copy (module docstring).
_EVERY_HOST = ocp.options.MultiprocessingOptions(primary_host=None)


class _PerHostNoise(logging.Filter):
    """orbax warns at every per-host save, on every process, that it skips an OCDBT merge
    (zarr has none) and that it logs no object sizes: both are this mode working."""

    EXPECTED = ("Skipping merge of OCDBT", "Global object size logging disabled")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.EXPECTED)


@functools.cache
def _quiet_per_host_warnings() -> None:
    logging.getLogger("absl").addFilter(_PerHostNoise())


def _state_handler(per_host: bool) -> ocp.StandardCheckpointHandler:
    """The handler of the `state` item. Every handler built sets the primary host of orbax's
    one array-metadata store (global), so a per-host process never builds a default one:
    its next save would wait for process 0 to create a directory on process 0's disk."""
    if not per_host:
        return ocp.StandardCheckpointHandler()
    return ocp.StandardCheckpointHandler(multiprocessing_options=_EVERY_HOST, use_ocdbt=False)


def _per_host_handlers():
    """orbax's handlers for per-host staging: no host waits on another's directory, and
    arrays in zarr files per chunk, each written by the process that holds it."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state = _state_handler(True)
    registry.add("state", ocp.args.StandardSave, state)
    registry.add("state", ocp.args.StandardRestore, state)
    for item in ("config", "sums"):
        handler = ocp.JsonCheckpointHandler(multiprocessing_options=_EVERY_HOST)
        registry.add(item, ocp.args.JsonSave, handler)
        registry.add(item, ocp.args.JsonRestore, handler)
    return registry


def _read_manifest(path: pathlib.Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if manifest.get("format") != 2:  # before checksums: {path: size}
        manifest = {"files": {k: [v, None] for k, v in manifest.items()}}
    return manifest


def _files_problem(root: pathlib.Path, files: dict, checksums: bool,
                   shown=None) -> str | None:
    """What is wrong with the files under `root` by their manifest's {name: [size, xxh3]}
    (named under `shown`, e.g. the URL they were downloaded from)."""
    for name, (size, digest) in files.items():
        path = storage.contained(root, name, f"the manifest of {shown or root}", CheckpointError)
        named = (shown or root) / name
        if not path.exists():
            return f"{named} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{named} is truncated ({actual} of {size} bytes)"
        if checksums and digest is not None and file_checksum(path) != digest:
            return f"{named} has changed (checksum {file_checksum(path)}, recorded {digest})"
    return None

