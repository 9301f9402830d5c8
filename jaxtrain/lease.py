"""The workdir lock on object storage: a lease object, WORKDIR/.lock, for as long as a run
uses a gs:// or s3:// workdir (workdir.WorkdirLock's twin; a bucket has no flock).

The lease is created with a precondition (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`),
so of two runs starting together exactly one creates it. It names its holder: host, pid,
since, argv, and what tells this run from any other with the same pid (a random id, the
boot id, the pid namespace and start time of its process, and the host lock it holds: a
flock in the workdir's scratch folder), and a heartbeat (unix time) that a daemon thread
rewrites every `heartbeat_s`. No kernel releases it when its holder dies, so a lease is
taken over only when its holder is known dead (this host and boot, and no such process:
the restart after kill -9, pid 1 again in a new container included) or its heartbeat is
older than `stale_s` (10 heartbeats by default: a holder that missed that many is gone or
cut off). A taker deletes the stale lease only if it is still the object it judged (S3
`If-Match`, GCS `ifGenerationMatch`), then creates its own with the precondition: of two
takers exactly one wins, and the other is refused by the lease the winner wrote.

Fencing: every write of the run to the workdir asks `Lease.check` first (storage.fence),
which refuses (LeaseLost, exit 75) once the lease was taken over, and reads it again when it
went unconfirmed for half the takeover time (a paused process), so a holder resumed after a
takeover stops before it writes.

A store that does not answer is not a takeover. While the lease cannot be read, nobody else
can take it either; a lease unconfirmed past the takeover time only holds the run's writes
back (LeaseUnconfirmed, which the retry policy tries again) and training goes on. Once the
store answers, a lease that is still the object this run last wrote (its holder id; the
rewrite is conditional on the version read, S3 If-Match, GCS ifGenerationMatch) is renewed
and the writes go out; one that another run wrote stops the run (LeaseLost). Only a store
without conditional writes still counts an unconfirmed lease as lost past the takeover time:
there a blind rewrite could land over a taker's lease.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import math
import os
import socket
import sys
import threading
import time
import uuid

from jaxtrain import retry, storage
from jaxtrain.errors import ConfigError, LeaseLost, LeaseUnconfirmed, WorkdirBusy

LEASE_FILE = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0
HEARTBEAT_ENV = "JAXTRAIN_LEASE_HEARTBEAT_S"
# A holder trusts its lease without asking the store for stale_s / 2 after its heartbeat,
# and would rewrite it blind (a store without conditional writes; S3 and GCS have them) only
# within 3/4 of stale_s: the rest is the margin for the write's own time and the hosts' clocks.
TRUST_WITHIN = 0.5
RENEW_WITHIN = 0.75
STALE_ENV = "JAXTRAIN_LEASE_STALE_S"


@dataclasses.dataclass(frozen=True)
class Seen:
    """The lease as read once: its holder (None when the content is not a lease), the
    object's version (S3 ETag, GCS generation) and when it was last written (unix time,
    the server's clock; None where the store does not say)."""
    holder: dict | None
    version: str | None
    modified: float | None
    empty: bool = False  # a lease never is: a released local .lock copied into the bucket


class Held:
    """A lock used as a context manager: acquired on entry, released on exit (Lease here,
    workdir.WorkdirLock on disk)."""

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _Heartbeat:
    """The held lease's side of Lease: its heartbeat thread, and the fencing every write
    asks (check). Uses Lease's store calls (_read, _blob) and its fields."""

    def _start(self) -> None:
        self.held = True
        self._confirmed = self._stamped
        self.lost.clear()
        storage.add_fence(self.check, self.workdir)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="jaxtrain-lease",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(self.heartbeat_s):
            with self._mutex:
                if self._stop.is_set():
                    return
                try:
                    confirmed = self._confirmed
                    if not self._renew():
                        return
                    if failing and self._confirmed > confirmed:
                        self.say(f"jaxtrain: renewed the lease {self.path}: the store answers "
                                 "again and the lease is still this run's")
                    failing = False
                except Exception as e:  # the store unreachable: try again next beat
                    if self._unconfirmed_is_lost() and self._overdue():
                        return
                    if not failing:
                        self.say(f"jaxtrain: could not renew the lease {self.path} "
                                 f"({storage.first_line(e)}); retrying every {self.heartbeat_s:g}s")
                    failing = True

    def _renew(self) -> bool:
        """Rewrites the lease with a fresh heartbeat if it is still ours; False (said once,
        `lost` set) when another run has taken it over, or may have (_overdue). Fencing: a
        taker judges by our last heartbeat, so once read as ours the lease is safe to
        rewrite only until that heartbeat is RENEW_WITHIN of stale_s old; on S3 and GCS the
        write is conditional on the version read (If-Match, ifGenerationMatch) and safe at
        any time."""
        began = time.monotonic()
        seen = self._read()
        if seen is None or not self._ours(seen):
            where = "it is gone" if seen is None else f"it is now held by {_describe(seen)}"
            self._lose(f"lost the lease {self.path}: {where}; its heartbeat stopped")
            return False
        conditional = storage.conditional_writes(self.path) and bool(seen.version)
        if not conditional and time.monotonic() - self._confirmed > RENEW_WITHIN * self.stale_s:
            return not self._overdue()  # too late to write blind: the next beat judges
        blob = self._blob()
        if conditional:  # safe however late: the store refuses it over another's write
            if not storage.put_if_match(self.path, blob, seen.version, self.stale_s / 4):
                return True  # changed since read: the next beat reads who holds it
        else:
            # Cut off where a blind write would no longer be safe: no heartbeat lands late.
            left = max(RENEW_WITHIN * self.stale_s - (time.monotonic() - self._confirmed), 0.1)
            storage.put(self.path, blob, budget=left, versioned=False)
        self._confirmed = began
        return True

    def _unconfirmed_is_lost(self) -> bool:
        """Whether a lease unconfirmed past the takeover time counts as lost: only on a store
        without conditional writes (module docstring)."""
        return not storage.conditional_writes(self.path)

    def _overdue(self) -> bool:
        """True (and `lost` set, said once) when the lease has not been confirmed for longer
        than the takeover time: another run may hold it now."""
        late = time.monotonic() - self._confirmed
        if late <= self.stale_s:
            return False
        self._lose(f"the heartbeat of the lease {self.path} failed for {late:.0f}s, longer "
                   f"than the takeover time ({self.stale_s:g}s): another run may hold it now")
        return True

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.say(f"jaxtrain: {reason}")
            self.lost.set()

    def check(self, path=None, confirm: bool = False) -> None:
        """Called before every write under the workdir (a storage fence): LeaseLost (one
        line) when the lease was lost; when it was not confirmed within stale_s / 2 (this
        process was paused, its heartbeat late), or `confirm` (the store refused a write
        conditional on this run's last version: storage.VersionedWrites), it is read and
        renewed first, so a holder resumed after a takeover stops before it writes. A store
        that does not answer lets the write through within the takeover time, and holds it
        back after that (LeaseUnconfirmed: the writer tries again) until the lease is read."""
        if path is not None and not str(path).startswith(f"{self.workdir}/"):
            return
        if str(path) == str(self.path):
            return
        late = time.monotonic() - self._confirmed
        if not self.lost.is_set() and (confirm or late > TRUST_WITHIN * self.stale_s):
            with self._mutex:
                try:
                    self._renew()
                except Exception as e:  # noqa: BLE001 - unreachable: judged by the time
                    if self._unconfirmed_is_lost():
                        self._overdue()
                    elif time.monotonic() - self._confirmed > self.stale_s:
                        raise LeaseUnconfirmed(
                            f"the lease {self.path} has not been confirmed for "
                            f"{time.monotonic() - self._confirmed:.0f}s "
                            f"({storage.first_line(e)}); the write waits for the store") from e
        if self.lost.is_set():
            raise LeaseLost(f"--workdir={self.workdir}: {self.lost_reason}; stopped before "
                            "writing")


class Lease(Held, _Heartbeat):
    """An exclusive lease on an object-storage run directory; the interface of WorkdirLock
    (acquire, release, a context manager). `lost` is set when the heartbeat finds the lease
    taken over by another run."""

    def __init__(self, workdir, say=print, *, heartbeat_s: float | None = None,
                 stale_s: float | None = None):
        self.workdir = storage.as_path(workdir, "--workdir")
        self.path = self.workdir / LEASE_FILE
        self.fs, self.fpath = None, ""  # the client, made in acquire (where its errors are)
        self.say = say
        self.heartbeat_s, self.stale_s = lease_times(heartbeat_s, stale_s)
        self.id = uuid.uuid4().hex  # tells two leases of one host and pid apart
        self.lost = threading.Event()
        self.lost_reason = ""
        self.held = False
        # When the lease was last known ours (time.monotonic() as its heartbeat was stamped):
        # a write is let through without asking the store only within stale_s / 2 of it.
        self._confirmed = self._stamped = -math.inf
        self._host = HostLock(self.workdir)
        self._since = ""
        self._stop = threading.Event()
        self._mutex = threading.Lock()  # a heartbeat and the release never interleave
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        try:
            if self.fs is None:
                self.fs, self.fpath = storage.filesystem(self.path)
            # The one retry policy: a lost connection while acquiring is tried again (a
            # create whose reply was lost finds its own lease: _ours).
            retry.call(lambda _timeout: self._acquire(), f"acquiring the lease {self.path}",
                       user_error=lambda e: storage.user_error(e, "--workdir", self.workdir))
        except ConfigError:
            raise
        except Exception as e:
            error = storage.user_error(e, "--workdir", self.workdir)
            if error is None:
                raise
            raise error from None

    def _acquire(self) -> None:
        self._since = now()
        self._host.take()
        taken, seen = None, None
        for _ in range(4):  # a lease that vanishes or changes under us: look again
            if self._create():
                if taken:
                    self.say(taken)
                self._start()
                return
            seen = self._read()
            if seen is None:
                continue
            if self._ours(seen):  # our create went through; its reply was lost
                self._start()
                return
            reason = self._stale(seen)
            if reason is None:
                break
            if self._delete_if_unchanged(seen):
                whose = f"of {_describe(seen)} ({self.path})" if seen.holder else self.path
                taken = f"jaxtrain: taking over the lease {whose}, {reason}"
        raise self._refusal(seen)

    def release(self) -> None:
        """Stops the heartbeat and deletes the lease if it is still ours; a lease this cannot
        delete (the store is unreachable) goes stale after stale_s."""
        storage.remove_fence(self.check)
        if not self.held:
            self._host.release()
            return
        self._stop.set()
        with self._mutex:
            self.held = False
            try:
                seen = self._read()
                if seen is not None and self._ours(seen):
                    self._delete_if_unchanged(seen)
            except Exception as e:
                self.say(f"jaxtrain: could not release the lease {self.path} "
                         f"({storage.first_line(e)}); the next run takes it over "
                         f"{self.stale_s:g}s after its last heartbeat")
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._host.release()

    # -- the object ---------------------------------------------------------------------

    def _blob(self) -> bytes:
        """The lease's content: who holds it (host, pid, and what tells this run from any
        other with the same pid: its id, the boot, pid namespace and start time of its
        process, and the host lock it holds) and a fresh heartbeat."""
        return (json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                            "since": self._since, "heartbeat": time.time(),
                            "argv": sys.argv, "id": self.id, **process_identity(),
                            "hostlock": self._host.identity()}) + "\n").encode()

    def _create(self) -> bool:
        """True when this call created the lease; False when one exists."""
        self._stamped = time.monotonic()
        try:
            self.fs.pipe_file(self.fpath, self._blob(), mode="create")
            return True
        except FileExistsError:
            return False

    def _read(self) -> Seen | None:
        """The lease as it is now, or None when there is none."""
        # Each request cut off within the takeover time: a hung store must not keep the
        # heartbeat from noticing that the lease may be lost (_overdue).
        timeout = self.stale_s / 4
        try:
            self.fs.invalidate_cache(self.fpath)
            info = storage.run_async(self.fs, self.fs._info(self.fpath), timeout)
            blob = storage.run_async(self.fs, self.fs._cat_file(self.fpath), timeout)
        except FileNotFoundError:
            return None
        version = info.get("ETag") or info.get("generation")
        return Seen(_parse(blob), str(version) if version else None, _modified(info),
                    empty=not blob.strip())

    def _delete_if_unchanged(self, seen: Seen) -> bool:
        """Deletes the lease only if it is still the object `seen`: checked by version first
        (the GCS emulator ignores a delete's precondition) and then by the store's own
        precondition, so a taker never deletes the lease another taker has just created."""
        now = self._read()
        if now is None or now.version != seen.version:
            return False
        try:
            storage.delete_if_match(self.path, seen.version)
        except (FileNotFoundError, FileExistsError):
            return False  # gone, or changed since (gcsfs: 412): the next create decides
        except OSError as e:
            if not storage.precondition_failed(e):
                raise
            return False
        self.fs.invalidate_cache(self.fpath)
        return True

    # -- judging a lease --------------------------------------------------------------

    def _ours(self, seen: Seen) -> bool:
        return seen.holder is not None and seen.holder.get("id") == self.id

    def _stale(self, seen: Seen) -> str | None:
        return stale_reason(seen, self.stale_s, self._host)

    def _refusal(self, seen: Seen | None) -> ConfigError:
        return refusal(self.workdir, self.path, seen, self.stale_s)


def stale_reason(seen: Seen, stale_s: float, host: HostLock) -> str | None:
    """Why the lease may be taken over ('which is no longer running', 'whose last
    heartbeat was 400s ago'), or None while its holder may be alive."""
    holder = seen.holder
    if seen.empty:
        return "which was released (the object is empty)"
    if holder is not None and dead_here(holder, host):
        return "which is no longer running"
    age = _age(seen)
    if age is not None and age > stale_s:
        if _believed_heartbeat(seen) is not None:
            return f"whose last heartbeat was {age:.0f}s ago"
        if _heartbeat(holder) is not None:
            return (f"whose heartbeat is stamped in the future and which was last "
                    f"written {age:.0f}s ago")
        unreadable = " is unreadable and" if holder is None else ""
        return f"which{unreadable} was last written {age:.0f}s ago"
    return None


def dead_here(holder: dict, host: HostLock) -> bool:
    """Whether the holder is a process of this host (same name and boot) that is known to
    be gone: in this pid namespace, no process with its pid and start time (a restart in a
    container is pid 1 again); in another (a container's restart has a new one), its host
    lock is free, which this run (`host`) now holds. A lease from before these fields
    judges by pid alone."""
    if holder.get("host") != socket.gethostname():
        return False
    if "boot" not in holder:
        return not _alive(holder.get("pid"))
    mine = process_identity()
    if holder.get("boot") != mine["boot"]:
        return False  # a reboot, or another machine of that name: the heartbeat decides
    if holder.get("pidns") == mine["pidns"]:
        return _start_time(holder.get("pid")) != holder.get("start")
    return host.held and holder.get("hostlock") == host.identity()


def refusal(workdir, path, seen: Seen | None, stale_s: float) -> WorkdirBusy:
    """The one line (exit code IN_USE) of a run refused by a live lease."""
    age = _age(seen) if seen is not None else None
    when = "unknown" if age is None else f"{age:.0f}s ago"
    return WorkdirBusy(f"--workdir={workdir} is in use by {_describe(seen)}, "
                       f"{_age_label(seen)} {when} ({path}; taken over after "
                       f"{stale_s:g}s without a heartbeat); wait for that run to "
                       "end or stop it, or use another --workdir")


def lease_times(heartbeat_s: float | None = None,
                stale_s: float | None = None) -> tuple[float, float]:
    """(heartbeat_s, stale_s): the arguments, else $JAXTRAIN_LEASE_HEARTBEAT_S and
    $JAXTRAIN_LEASE_STALE_S, else 30 s and 300 s; ConfigError (one line) for a value that
    is not a positive number, or a stale time not above the heartbeat."""
    heartbeat = _seconds(HEARTBEAT_ENV, heartbeat_s, HEARTBEAT_S)
    stale = _seconds(STALE_ENV, stale_s, STALE_S)
    if stale <= heartbeat:
        raise ConfigError(f"{STALE_ENV}={stale:g} must be more than {HEARTBEAT_ENV}="
                          f"{heartbeat:g} (seconds), or a live run's lease looks stale "
                          "between two heartbeats; 10 heartbeats is the default")
    return heartbeat, stale


def _seconds(name: str, given, default: float) -> float:
    raw = given if given is not None else os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw}: must be a number of seconds > 0")
    return value


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _parse(blob: bytes) -> dict | None:
    try:
        holder = json.loads(blob)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _heartbeat(holder: dict | None) -> float | None:
    beat = (holder or {}).get("heartbeat")
    return float(beat) if isinstance(beat, (int, float)) and math.isfinite(beat) else None


# How far a heartbeat may lie ahead of this host's clock (two hosts' clocks differ a little)
# before it is not believed: a heartbeat from the future would never go stale.
FUTURE_TOLERANCE_S = 5.0


def _believed_heartbeat(seen: Seen) -> float | None:
    """The holder's heartbeat, unless it is stamped in the future (a holder's clock far
    ahead, or a forged lease): then the object's own write time (the server's clock)
    stands in, as for content that is no lease."""
    when = _heartbeat(seen.holder)
    if when is not None and when > time.time() + FUTURE_TOLERANCE_S:
        return None
    return when


def _age(seen: Seen) -> float | None:
    """Seconds since the holder's last heartbeat; for content that is no lease (garbage, a
    local .lock copied into the bucket) or a heartbeat stamped in the future, since the
    object was last written."""
    when = _believed_heartbeat(seen)
    if when is None:
        when = seen.modified
    return None if when is None else max(0.0, time.time() - when)


def _age_label(seen: Seen | None) -> str:
    if seen is None or _heartbeat(seen.holder) is None:
        return "last written"
    if _believed_heartbeat(seen) is None:
        ahead = _heartbeat(seen.holder) - time.time()
        return f"heartbeat stamped {ahead:.0f}s in the future, last written"
    return "last heartbeat"


def _modified(info: dict) -> float | None:
    """The object's last write, as the store reports it: S3 'LastModified' (a datetime,
    whole seconds), gcsfs 'mtime' (a datetime) or 'updated' (RFC 3339 text)."""
    for key in ("LastModified", "mtime", "updated"):
        value = info.get(key)
        if isinstance(value, str):
            try:
                value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.UTC)
            return value.timestamp()
    return None


class HostLock:
    """A flock on a file of this host's scratch folder for the workdir, held for as long as
    the lease: the kernel releases it however its holder dies, and every pid namespace of
    the host sees it. A run that finds a lease of this host naming this very file (device
    and inode) while it holds the flock itself knows that lease's holder is gone, though
    its pid is not visible from here (a container restarted in a new pid namespace)."""

    def __init__(self, workdir):
        self.path = storage.scratch_dir(workdir, "lease") / "host.lock"
        self.handle = None
        self.held = False

    def take(self) -> None:
        """Takes the flock if no other process of this host holds it (no wait)."""
        if self.handle is None:
            self.handle = open(self.path, "a+")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.held = True
        except OSError:
            self.held = False

    def identity(self) -> list[int] | None:
        """[device, inode] of the file while this run holds its flock, else None."""
        if not self.held:
            return None
        stat = os.fstat(self.handle.fileno())
        return [stat.st_dev, stat.st_ino]

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing drops the flock
        self.handle, self.held = None, False


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _start_time(pid) -> int | None:
    """The start time of process `pid` in this pid namespace (clock ticks since boot, field
    22 of /proc/PID/stat), or None when there is no such process."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return int(fields[19]) if len(fields) > 19 else None


def process_identity() -> dict:
    """What tells this process from any other that has, or had, its pid: the host's boot,
    its pid namespace, and its start time."""
    boot = (_read_text("/proc/sys/kernel/random/boot_id") or "").strip() or None
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"boot": boot, "pidns": pidns, "start": _start_time(os.getpid())}


def _alive(pid) -> bool:
    """False only when no process has this pid here; anything unclear counts as alive."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True  # os.kill(0 or -1, ...) would signal a whole group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def _describe(seen: Seen | None) -> str:
    """'pid 4242 on node-7 since 2026-12-01T03:10:00+00:00', or what is known of a lease
    whose content is not one."""
    holder = seen.holder if seen is not None else None
    if holder is None:
        return "another process (its lease is unreadable)"
    return describe_holder(holder)


def describe_holder(holder: dict) -> str:
    """'pid 4242 on node-7 since ...': who holds a workdir, by lease or by flock."""
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since "
            f"{holder.get('since', '?')}")

