"""The run's outbox: what a training run writes to its workdir while it trains (metrics
segments, goodput.json, config.json, TensorBoard's event files), written by one background
thread under the one retry policy (retry.py), so that the training thread never waits on the
store, however long it does not answer.

- Jobs are written in the order given. One that fails (the store did not take it within the
  retry budget) is said in one line and stays where it is: it is tried again every few
  seconds, and the jobs queued after it wait, so rows stay in order. While the store does
  not answer, "still trying" is said every $JAXTRAIN_STORAGE_STALL_S seconds (30), and the
  end of the outage in one line.
- A job with a key replaces the job of that key still waiting (goodput.json, config.json,
  TensorBoard's folder: each write is the whole thing, and only the newest matters), so an
  outage holds one copy of each; `every_s` spaces the writes of a key (each is a billed PUT).
- What waits is bounded: BOUND_BYTES (64 MiB; $JAXTRAIN_OUTBOX_MB), a few hundred thousand
  metrics rows. A job past the bound stops the run (StoreUnavailable, exit code 75) with
  what waits kept on this host's scratch disk, named in the message: going on would lose it.
- A lost lease (LeaseLost) stops the thread: nothing more may be written.
- close() waits for every job, saying so while it waits, up to $JAXTRAIN_STORAGE_FINAL_S
  (600 s); what is still unwritten then is kept on the scratch disk, named in one line, and
  StoreUnavailable (exit code 75) ends the command.

On a local disk there is nothing to wait for: each job runs at once on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time
from collections.abc import Callable

from jaxtrain import retry, storage
from jaxtrain.errors import LeaseLost, StoreUnavailable

BOUND_ENV = "JAXTRAIN_OUTBOX_MB"
BOUND_MB = 64.0
FINAL_ENV = "JAXTRAIN_STORAGE_FINAL_S"
FINAL_S = 600.0
RETRY_PAUSE_S = 5.0  # between two retry budgets of a job the store did not take


def retry_pause_s() -> float:
    """The pause before a write the store did not take is tried again (no longer than the
    retry budget itself)."""
    return min(RETRY_PAUSE_S, retry.budget_s())


@dataclasses.dataclass(eq=False)  # a job is itself: compared by identity
class Job:
    """One write: `write()` raises when the store did not take it; `keep(folder)` saves what
    it holds under `folder` when the run ends without it stored, and returns what it wrote
    there (a name to give the user)."""
    write: Callable[[], None]
    what: str  # "3 metrics rows", "goodput.json": for messages
    where: str  # the object or folder it writes to
    keep: Callable[[pathlib.Path], str]
    size: int = 0
    key: str | None = None
    not_before: float = 0.0


def blob_job(path, blob: bytes, key: str | None = None) -> Job:
    """A job that writes `blob` as the object `path` (kept as the file of that name)."""
    def keep(folder: pathlib.Path) -> str:
        target = folder / pathlib.PurePosixPath(str(path)).name
        target.write_bytes(blob)
        return str(target)
    return Job(lambda: storage.put(path, blob), pathlib.PurePosixPath(str(path)).name,
               str(path), keep, len(blob), key)


class Outbox:
    """The writer of one workdir (module docstring): submit(job), put(path, data), sync(),
    close()."""

    def __init__(self, workdir, say):
        self.workdir, self.say = workdir, say
        self.remote = not storage.on_disk(workdir)
        self.bound = retry.env_number(BOUND_ENV, BOUND_MB, unit="MiB") * 2**20
        self.jobs: list[Job] = []
        self.written: dict[str, float] = {}  # key -> when its last write began
        self.error: BaseException | None = None
        self.failures = 0  # failed attempts (each a whole retry budget), for sync()
        self._cond = threading.Condition()
        self._closing = self._abandoned = False
        self._going_on = "training goes on"
        self._thread: threading.Thread | None = None

    # -- the training thread's side ------------------------------------------------------

    def put(self, path, data: bytes | str, every_s: float = 0.0) -> None:
        """Writes the whole object `path`, replacing a write of it still waiting."""
        blob = data.encode() if isinstance(data, str) else data
        if not self.remote:
            storage.atomic_write(path, blob)
            return
        self.submit(blob_job(path, blob, key=str(path)), every_s)

    def submit(self, job: Job, every_s: float = 0.0) -> None:
        if not self.remote:
            job.write()
            return
        with self._cond:
            if self._abandoned:
                return
            if job.key is not None:
                job.not_before = self.written.get(job.key, -every_s) + every_s
                waiting = [j for j in self.jobs if j.key == job.key and j is not self._busy]
                if waiting:  # the newest replaces it where it stood
                    self.jobs[self.jobs.index(waiting[0])] = job
                    return
            held = sum(j.size for j in self.jobs) + job.size
            if held > self.bound:
                self._abandoned = True
                kept = self._keep_all([*self.jobs, job])
                raise StoreUnavailable(
                    f"the store {self.workdir} has not taken this run's writes, and what "
                    f"waits for it reached {self.bound / 2**20:g} MiB (${BOUND_ENV}); kept in "
                    f"{kept}; copy it there once the store answers; stopped")
            self.jobs.append(job)
            self._start()
            self._cond.notify_all()

    def sync(self, timeout: float | None = None) -> bool:
        """Waits until every job queued so far is written, or a write has failed since (a
        whole retry budget: the store does not answer, and the rest waits behind it);
        False when `timeout` ran out first."""
        with self._cond:
            target, failures = list(self.jobs), self.failures
            return self._cond.wait_for(
                lambda: self.error is not None or self._abandoned or self.failures > failures
                or all(j not in self.jobs for j in target), timeout)

    def close(self, final_s: float | None = None) -> None:
        """Waits for every job (module docstring), then StoreUnavailable naming what was kept
        on the scratch disk if any is left, or LeaseLost if the lease was lost."""
        if not self.remote or self._thread is None:
            return
        final_s = retry.env_number(FINAL_ENV, FINAL_S) if final_s is None else final_s
        with self._cond:
            if self._abandoned:  # stopped at the bound: what waited is kept already
                return
            self._closing, self._going_on = True, f"waiting up to {final_s:g}s (${FINAL_ENV})"
            for job in self.jobs:
                job.not_before = 0.0  # no more spacing: the last of each key now
            self._cond.notify_all()
        self._thread.join(final_s)
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
            left = list(self.jobs)
        if not left:
            return
        kept = self._keep_all(left)
        if isinstance(self.error, LeaseLost):
            raise LeaseLost(f"{self.error}; what it had not written is kept in {kept}")
        raise StoreUnavailable(
            f"the store did not take the run's last writes to {self.workdir} within "
            f"{final_s:g}s (${FINAL_ENV}): {', '.join(j.what for j in left)}; kept in "
            f"{kept}; copy them there once the store answers")

    def _keep_all(self, jobs: list[Job]) -> str:
        folder = storage.scratch_dir(self.workdir, f"unsent-{int(time.time())}")
        for job in jobs:
            job.keep(folder)
        return str(folder)

    # -- the writer thread ------------------------------------------------------------------

    _busy: Job | None = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxtrain-outbox",
                                            daemon=True)
            self._thread.start()

    def _next(self) -> Job | None:
        """The first job that may go now: keyed jobs once their spacing is over, the others
        in order (none passes an earlier unkeyed job)."""
        now = time.monotonic()
        for job in self.jobs:
            if job.not_before <= now:
                return job
            if job.key is None:
                return None
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while (job := self._next()) is None:
                    if self._abandoned or (self._closing and not self.jobs):
                        return
                    soonest = min((j.not_before for j in self.jobs), default=None)
                    self._cond.wait(None if soonest is None else
                                    max(soonest - time.monotonic(), 0.01))
                if self._abandoned:
                    return
                self._busy = job
            if not self._write(job):
                return

    def _write(self, job: Job) -> bool:
        """Writes `job` until the store takes it; False when the thread must stop."""
        failed = False
        with retry.watch(f"writing {job.where}", self.say, going_on=lambda: self._going_on):
            while True:
                if job.key is not None:
                    self.written[job.key] = time.monotonic()
                try:
                    job.write()
                    break
                except LeaseLost as e:
                    with self._cond:
                        self.error, self._busy = e, None
                        self._cond.notify_all()
                    return False
                except Exception as e:  # noqa: BLE001 - kept, said once, tried again
                    if not failed:
                        self.say(f"jaxtrain: could not store {job.what} in {job.where} "
                                 f"({_reason(e)}); kept in memory and written when the store "
                                 "answers")
                    failed = True
                with self._cond:
                    self.failures += 1
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._abandoned, retry_pause_s())
                    if self._abandoned:
                        return False
        if failed:
            self.say(f"jaxtrain: stored {job.what} in {job.where}: the store answers again")
        with self._cond:
            self.jobs.remove(job)
            self._busy = None
            self._cond.notify_all()
        return True


def _reason(error: BaseException) -> str:
    return str(error) if isinstance(error, retry.Unreachable) else storage.first_line(error)
