"""The workdir lock on object storage: a lease object, WORKDIR/.lock, for as long as a run
uses a gs:// or s3:// workdir (workdir.WorkdirLock's twin; a bucket has no flock).

The lease is created with a precondition (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`),
so of two runs starting together exactly one creates it. It names its holder (host, pid,
since, argv) and a heartbeat (unix time) that a daemon thread rewrites every `heartbeat_s`.
No kernel releases it when its holder dies, so a lease is taken over only when its holder
is known dead (same host, no such pid: the restart after kill -9) or its heartbeat is older
than `stale_s` (10 heartbeats by default: a holder that missed that many is gone or cut off).
A taker deletes the stale lease only if it is still the object it judged (S3 `If-Match`,
GCS `ifGenerationMatch`), then creates its own with the precondition: of two takers exactly
one wins, and the other is refused by the lease the winner wrote.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import socket
import sys
import threading
import time
import uuid

from jaxtrain import storage
from jaxtrain.errors import ConfigError

LEASE_FILE = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0
HEARTBEAT_ENV = "JAXTRAIN_LEASE_HEARTBEAT_S"
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


class Lease:
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
        self.held = False
        self._since = ""
        self._stop = threading.Event()
        self._mutex = threading.Lock()  # a heartbeat and the release never interleave
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        try:
            if self.fs is None:
                self.fs, self.fpath = storage.filesystem(self.path)
            self._acquire()
        except ConfigError:
            raise
        except Exception as e:
            error = storage.user_error(e, "--workdir", self.workdir)
            if error is None:
                raise
            raise error from None

    def _acquire(self) -> None:
        self._since = now()
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
        if not self.held:
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

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- the object ---------------------------------------------------------------------

    def _blob(self) -> bytes:
        return (json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                            "since": self._since, "heartbeat": time.time(),
                            "argv": sys.argv, "id": self.id}) + "\n").encode()

    def _create(self) -> bool:
        """True when this call created the lease; False when one exists."""
        try:
            self.fs.pipe_file(self.fpath, self._blob(), mode="create")
            return True
        except FileExistsError:
            return False

    def _read(self) -> Seen | None:
        """The lease as it is now, or None when there is none."""
        try:
            self.fs.invalidate_cache(self.fpath)
            info = self.fs.info(self.fpath)
            blob = self.fs.cat_file(self.fpath)
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
        bucket, key = self.fpath.split("/", 1)
        try:
            if storage.scheme_of(self.path) == "s3" and seen.version:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=seen.version)
            elif storage.scheme_of(self.path) == "gs" and seen.version:
                self.fs.call("DELETE", "b/{}/o/{}", bucket, key,
                             ifGenerationMatch=seen.version)
            else:
                self.fs.rm_file(self.fpath)
        except (FileNotFoundError, FileExistsError):
            return False  # gone, or changed since (gcsfs: 412): the next create decides
        except OSError as e:
            if not _precondition_failed(e):
                raise
            return False
        self.fs.invalidate_cache(self.fpath)
        return True

    # -- judging a lease --------------------------------------------------------------

    def _ours(self, seen: Seen) -> bool:
        return seen.holder is not None and seen.holder.get("id") == self.id

    def _stale(self, seen: Seen) -> str | None:
        """Why the lease may be taken over ('which is no longer running', 'whose last
        heartbeat was 400s ago'), or None while its holder may be alive."""
        holder = seen.holder
        if seen.empty:
            return "which was released (the object is empty)"
        if holder is not None and holder.get("host") == socket.gethostname() \
                and not _alive(holder.get("pid")):
            return "which is no longer running"
        age = _age(seen)
        if age is not None and age > self.stale_s:
            if _believed_heartbeat(seen) is not None:
                return f"whose last heartbeat was {age:.0f}s ago"
            if _heartbeat(holder) is not None:
                return (f"whose heartbeat is stamped in the future and which was last "
                        f"written {age:.0f}s ago")
            unreadable = " is unreadable and" if holder is None else ""
            return f"which{unreadable} was last written {age:.0f}s ago"
        return None

    def _refusal(self, seen: Seen | None) -> ConfigError:
        age = _age(seen) if seen is not None else None
        when = "unknown" if age is None else f"{age:.0f}s ago"
        return ConfigError(f"--workdir={self.workdir} is in use by {_describe(seen)}, "
                           f"{_age_label(seen)} {when} ({self.path}; taken over after "
                           f"{self.stale_s:g}s without a heartbeat); wait for that run to "
                           "end or stop it, or use another --workdir")

    # -- the heartbeat ----------------------------------------------------------------

    def _start(self) -> None:
        self.held = True
        self.lost.clear()
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
                    if not self._renew():
                        return
                    failing = False
                except Exception as e:  # the store unreachable: try again next beat
                    if not failing:
                        self.say(f"jaxtrain: could not renew the lease {self.path} "
                                 f"({storage.first_line(e)}); retrying every {self.heartbeat_s:g}s")
                    failing = True

    def _renew(self) -> bool:
        """Rewrites the lease with a fresh heartbeat if it is still ours; False (said once,
        `lost` set) when another run has taken it over."""
        seen = self._read()
        if seen is None or not self._ours(seen):
            where = "it is gone" if seen is None else f"it is now held by {_describe(seen)}"
            self.say(f"jaxtrain: lost the lease {self.path}: {where}; its heartbeat stopped")
            self.lost.set()
            return False
        storage.atomic_write(self.path, self._blob())
        return True


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


def _precondition_failed(error: BaseException) -> bool:
    """S3's 412 (the object changed since) or 409 (a concurrent write won), as s3fs raises
    them: an OSError whose cause holds the S3 error code."""
    text = f"{error} {error.__cause__ or ''}"
    return any(code in text for code in ("PreconditionFailed", "pre-conditions",
                                         "ConditionalRequestConflict"))


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

