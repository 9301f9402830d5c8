"""The local tier of Checkpoints: a directory on disk, written and read by orbax, with a
manifest per step beside it.

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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import pathlib
import threading
import time

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from etils import epath
from jax.experimental import multihost_utils

from jaxtrain import storage
from jaxtrain.checkpoint_tier import Checkpoints
from jaxtrain.errors import CheckpointError
from jaxtrain.fingerprints import file_checksum, tree_bits, tree_signature, tree_sums

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


class LocalCheckpoints(Checkpoints, where="local"):
    """A directory on disk (module docstring); process 0 writes the manifests and moves
    damaged steps, a reader (read_only) writes nothing."""

    def __init__(self, directory, keep: int, keep_period: int = 0, log=print, manifests=None,
                 on_commit=None, read_only: bool = False):
        super().__init__(keep, keep_period, log, on_commit, read_only)
        self.directory = pathlib.Path(directory).absolute()
        self.manifests = pathlib.Path(
            manifests or self.directory.parent / "checkpoint_manifests").absolute()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "jaxtrain-manifest")
        self._lock = threading.Lock()
        options = ocp.CheckpointManagerOptions(
            # A reader's options are the ones orbax would force for read_only anyway, so it
            # has nothing to warn about on the one-line error paths of generate/eval.
            max_to_keep=None, create=not read_only, read_only=read_only,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=True, cleanup_tmp_directories=not read_only,
            enable_background_delete=True,
            async_options=ocp.options.AsyncOptions(
                post_finalization_callback=self._committed_async))
        with _quiet(read_only):
            self.manager = ocp.CheckpointManager(self.directory, options=options,
                                                 item_names=("state", "config", "sums"))
        self.healthy = {s for s in self.steps() if self._manifest(s).get("healthy")}
        self._manifested = set(self.steps())  # committed before this run

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    # Saving

    def save(self, step: int, tree: dict, config: dict, last: bool = False) -> None:
        """Starts an async save of a pytree of arrays (the train state's tree()), the run's
        config and the tree's fingerprints (the device-to-host copy happens before this
        returns). `last` (the run's final save) changes nothing on a disk."""
        del last
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(tree), config=ocp.args.JsonSave(config),
            sums=ocp.args.JsonSave({"sum_of_squares": tree_sums(tree),
                                    "bit_sums": tree_bits(tree)})), force=True)

    def wait(self) -> None:
        """Blocks until every started save is committed and has its manifest."""
        self.manager.wait_until_finished()
        self._executor.submit(self._write_manifests).result()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        self.manager.close()

    def _committed_async(self) -> None:
        """orbax's post-finalization callback, on its thread just before it renames the
        step's temporary directory to its final name: checksums on ours, once renamed."""
        self._executor.submit(self._write_manifests, _COMMIT_WAIT_S)

    def _write_manifests(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        with self._lock:
            for step in self.steps():
                if step in self._manifested:
                    continue
                root = self.directory / str(step)
                while not root.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
                if not root.exists():
                    continue  # not renamed yet: the next call writes it
                if self.primary and not self._manifest_path(step).exists():
                    files = {str(p.relative_to(root)): [p.stat().st_size, file_checksum(p)]
                             for p in sorted(root.rglob("*")) if p.is_file()}
                    self._write_manifest(step, {"format": 2, "files": files,
                                                "healthy": step in self.healthy})
                self._manifested.add(step)
                if self.on_commit is not None:
                    self.on_commit(step)

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

    # Health and rotation

    def _record_health(self, step: int) -> None:
        """Persists the mark, off the training thread (a step not yet committed gets it
        with its manifest)."""
        def record():
            with self._lock:
                manifest = _read_manifest(self._manifest_path(step))
                if self.primary and manifest and not manifest.get("healthy"):
                    self._write_manifest(step, {**manifest, "healthy": True})
        self._executor.submit(record)

    def _delete(self, step: int) -> None:
        self.manager.delete(step)
        if self.primary:
            self._manifest_path(step).unlink(missing_ok=True)

    # Restoring

    def _read(self, step: int, verify: bool, target: dict, check_config):
        """(restored tree, saved config, saved sums, None) or (.., what is wrong)."""
        problem = self.verify(step) if verify else None
        if problem is not None:
            return None, None, None, problem
        try:
            saved, sums = self.restore_config(step), self.restore_sums(step)
        except Exception as e:  # noqa: BLE001 - any failure to read is damage
            return None, None, None, f"its config cannot be read ({storage.first_line(e)})"
        check_config(step, saved, self.mismatch(step, target))
        try:
            return self.restore(step, target), saved, sums, None
        except Exception as e:  # noqa: BLE001 - see below
            if verify and self._checksummed(step):
                # Every byte is as written: the failure is not the checkpoint's (memory,
                # I/O, a bug), so it stays where it is.
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} passed its checksums but "
                    f"could not be restored ({storage.first_line(e)}); nothing was moved"
                ) from e
            return None, None, None, f"it cannot be restored ({storage.first_line(e)})"

    def restore(self, step: int, target: dict) -> dict:
        """Restores into `target`'s shapes and shardings (a pytree of ShapeDtypeStructs with
        shardings: any mesh, orbax reshards)."""
        return self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target))).state

    def signature(self, step: int) -> dict[tuple, tuple]:
        """tree_signature of a step's saved tree, read from its metadata (nothing restored)."""
        return tree_signature(ocp.StandardCheckpointHandler().metadata(
            epath.Path(self.directory / str(step) / "state")))

    def restore_items(self, step: int, target: dict) -> dict:
        """Only the top-level entries of the saved tree that `target` names (e.g. params and
        a LoRA run's base_fingerprint), into its shapes and shardings."""
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
        return self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore())).config

    def restore_sums(self, step: int) -> dict | None:
        """The fingerprints recorded when `step` was saved: {"sum_of_squares": tree_sums,
        "bit_sums": tree_bits (absent before they were recorded)}; None: saved before
        either was."""
        if not (self.directory / str(step) / "sums").exists():
            return None
        return dict(self.manager.restore(step, args=ocp.args.Composite(
            sums=ocp.args.JsonRestore())).sums)

    def set_aside(self, step: int):
        """Moves a damaged step out of orbax's sight (so that the resumed run can save that
        step again) into <dir>_damaged/, keeping it for inspection. Returns where it went."""
        aside = (self.directory.parent / f"{self.directory.name}_damaged"
                 / f"{step}-{int(time.time())}")
        if self.primary:
            aside.parent.mkdir(parents=True, exist_ok=True)
            (self.directory / str(step)).rename(aside)
            self._manifest_path(step).unlink(missing_ok=True)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxtrain_set_aside_{step}")
        self.manager.reload()
        self.healthy.discard(step)
        self._manifested.discard(step)  # the run saves this step again: a new manifest
        return aside

    # Manifests: relative path -> [size, xxh3] of every file of a committed step.

    def _manifest_path(self, step: int) -> pathlib.Path:
        return self.manifests / f"{step}.json"

    def _write_manifest(self, step: int, manifest: dict) -> None:
        self.manifests.mkdir(parents=True, exist_ok=True)
        storage.write_json(self._manifest_path(step), manifest, indent=0)

    def _manifest(self, step: int) -> dict:
        return _read_manifest(self._manifest_path(step))

    def _checksummed(self, step: int) -> bool:
        files = self._manifest(step).get("files", {})
        return bool(files) and all(digest for _, digest in files.values())

    def verify(self, step: int, checksums: bool = True) -> str | None:
        """What is wrong with a step's files (None: nothing, or no manifest yet: orbax's
        atomic commit vouches for it)."""
        return _files_problem(self.directory / str(step),
                              self._manifest(step).get("files", {}), checksums)


def _read_manifest(path: pathlib.Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if manifest.get("format") != 2:  # before checksums: {path: size}
        manifest = {"files": {k: [v, None] for k, v in manifest.items()}}
    return manifest


def _files_problem(root: pathlib.Path, files: dict, checksums: bool) -> str | None:
    """What is wrong with the files under `root` by their manifest's {name: [size, xxh3]}."""
    for name, (size, digest) in files.items():
        path = storage.contained(root, name, f"the manifest of {root}", CheckpointError)
        named = root / name
        if not path.exists():
            return f"{named} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{named} is truncated ({actual} of {size} bytes)"
        if checksums and digest is not None and file_checksum(path) != digest:
            return f"{named} has changed (checksum {file_checksum(path)}, recorded {digest})"
    return None
