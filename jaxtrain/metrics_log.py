"""The metrics log of a run directory: every row a run logs, read back in order by a resume
(the restored step's logged loss, and keeping the rows up to the checkpoint) and by
`jaxtrain report`. The workdir is a `storage.as_path` result, local or remote.

On a local disk it is WORKDIR/metrics.jsonl, one JSON object per line, each row appended in
one unbuffered write, so a reader of a live run sees whole rows.

Object stores have no append, so there the log is a sequence of segment objects, each a
whole JSONL file written in one PUT (an object is only ever seen whole):

    WORKDIR/metrics/SSSSSSSS-NNNNNN.jsonl      session S, its N-th segment (zero-padded)

Rows are read in (session, segment, line) order: a total order that needs no clock. A
writer's session takes its number when it writes its first segment (N = 0): one more than
the highest listed, by conditional create (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`),
so two writers never share one, and a run resumed after another gets a higher one. Other
objects under metrics/ are ignored.

When rows are durable: a writer (MetricsLog) keeps rows in memory and hands them to the
run's outbox (outbox.py) at the first row logged `flush_s` seconds (60) after the last
flush, on flush() and on close(); its thread writes each flush as one segment under the one
retry policy (retry.py), so the training thread never waits on the store. The loop flushes
before every checkpoint save (train/checkpointing.py), so the rows up to a checkpoint's step
are on their way before it commits; a killed run loses only the rows not stored yet, which
its resume logs again from its checkpoint's step. An outage within the retry budget costs no
row; a longer one is one line, its rows wait in memory (bounded: outbox.py) and go out in
order when the store answers, or, at the end of a run the store never answered, are kept on
the scratch disk and named. A stall is said while it lasts. Requests: at most 3600 / flush_s
PUTs an hour (60 at the default), plus one per checkpoint save that has rows to write and one
LIST when a session writes its first segment; reading is one LIST and a GET per segment.

A resume (keep_metrics_up_to) rewrites the log without rename, in two phases: (1) a base
segment, the first of a new session S, holds the kept rows after the header line
{"supersedes_sessions_below": S}; (2) every segment of a session below S is deleted. A
reader starts at the newest base and ignores the sessions below it, so a crash before (1)
completes leaves the old segments as they were, and a crash after it leaves the kept rows
exactly once; the next resume deletes what (2) left.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import threading
import time

from jaxtrain import retry, storage
from jaxtrain.outbox import Job, Outbox
from jaxtrain.workdir import METRICS_DIR as SEGMENTS_DIR
from jaxtrain.workdir import METRICS_FILE

FLUSH_S = 60.0  # seconds between segments: each is one PUT, and PUTs cost money
BASE_KEY = "supersedes_sessions_below"
_SEGMENT = re.compile(r"^(\d{8})-(\d{6})\.jsonl$")
_READ_TRIES = 3  # a segment deleted between listing and reading: a resume rewrote the log


def location(workdir):
    """Where the log of `workdir` lives: metrics.jsonl, or the metrics/ prefix of segments."""
    return workdir / (METRICS_FILE if storage.on_disk(workdir) else SEGMENTS_DIR)


def read_metrics(workdir, say=print) -> list[dict]:
    """The logged rows of the run in `workdir`, in order. Local: a partial last line (a run
    killed mid-write) is dropped with a message, any other bad line is reported by its
    number and skipped. Remote: a segment that is not whole JSON lines is reported by name
    and skipped."""
    if not storage.on_disk(workdir):  # no append there: segments
        return _read_remote(location(workdir), say)
    path = location(workdir)
    if not path.exists():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            where = "its last line is partial (a run stopped while writing it)" \
                if number == len(lines) else f"line {number} is not JSON"
            say(f"jaxtrain: {path}: {where}; dropped")
    return rows


def keep_metrics_up_to(workdir, step: int, say=print) -> None:
    """On resume, keep the logged rows up to the checkpoint's step (the resumed run logs the
    later ones again); a run that starts afresh at step 0 keeps none."""
    remote, where = not storage.on_disk(workdir), location(workdir)
    if not (_listing(where) if remote else where.exists()):
        return
    rows = [r for r in read_metrics(workdir, say) if 0 < step and r.get("step", 0) <= step]
    if remote:
        _drop_superseded(where, _write_base(where, rows))
    else:
        storage.atomic_write(where, _jsonl(rows))


class MetricsLog:
    """The writer of a run's metrics log: write(row) per row, flush() to make the rows so
    far durable, close() at the end. Local rows are on disk when write returns. Remote ones
    are kept and handed, one segment per flush, to the run's outbox (outbox.py: its writer
    thread, or one of the log's own): the training thread never waits on the store."""

    def __init__(self, workdir, flush_s: float = FLUSH_S, say=None, outbox=None):
        self.file = None
        self.segments = None
        if storage.on_disk(workdir):  # appended to; an object store has no append
            self.file = open(location(workdir), "ab", buffering=0)
        else:
            self.segments = SegmentWriter(location(workdir), flush_s, say or _say, outbox)

    @property
    def flush_s(self) -> float:
        return self.segments.flush_s

    @flush_s.setter
    def flush_s(self, value: float) -> None:
        self.segments.flush_s = value

    def write(self, row: dict) -> None:
        line = json.dumps(row) + "\n"
        if self.segments is not None:
            self.segments.write(line)
            return
        # One unbuffered write per row: whoever reads the file of a live run sees whole rows
        # (a line-buffered file could flush a row in two pieces around its buffer).
        self.file.write(line.encode())

    def flush(self) -> None:
        """Local: nothing to do (every row is in the file). Remote: hands the rows so far to
        the outbox and returns at once; sync() waits for them."""
        if self.segments is not None:
            self.segments.flush()

    def sync(self, timeout: float | None = None) -> bool:
        """Waits until every row flushed so far is stored, or its write was tried for a
        whole retry budget; False when `timeout` ran out first."""
        return True if self.segments is None else self.segments.outbox.sync(timeout)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        else:
            self.segments.close()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class SegmentWriter:
    """The remote log's rows. They wait in memory until a flush hands them to the outbox as
    one segment; the outbox writes segments in order under the one retry policy, and keeps
    one the store does not take (trying it again, the later ones behind it) until the store
    answers, or the run ends and it is kept on the scratch disk (outbox.py)."""

    def __init__(self, directory, flush_s: float, say, outbox: Outbox | None = None):
        self.directory, self.flush_s, self.say = directory, flush_s, say
        self.owns = outbox is None  # a log of its own (the tests, a tool): closed with it
        self.outbox = Outbox(directory, say) if outbox is None else outbox
        self.lines: list[str] = []  # rows not flushed yet
        self.session: int | None = None  # taken by the first segment
        self.seq = 0
        self.flushed = time.monotonic()
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)
        if time.monotonic() - self.flushed >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        self.flushed = time.monotonic()
        with self._lock:
            lines, self.lines = self.lines, []
        if not lines:
            return
        blob = "".join(lines)
        self.outbox.submit(Job(lambda: self._store(blob), f"{len(lines)} metrics rows",
                               str(self.directory), lambda folder: _keep(folder, blob),
                               len(blob)))

    def close(self) -> None:
        """Flushes; a log of its own also waits for its outbox (outbox.Outbox.close)."""
        self.flush()
        if self.owns:
            self.outbox.close()

    def _store(self, blob: str) -> None:
        """Writes one segment (raises when the store did not take it)."""
        if self.session is None:
            self.session = _claim(self.directory, blob)
        else:
            storage.put(self.directory / _name(self.session, self.seq), blob.encode())
        self.seq += 1


def _keep(folder: pathlib.Path, blob: str) -> str:
    """A segment the store never took, as a file of the scratch folder the outbox names."""
    target = folder / "metrics" / f"unsent-{time.monotonic_ns()}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(blob)
    return str(target)


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _name(session: int, seq: int) -> str:
    return f"{session:08d}-{seq:06d}.jsonl"


def _listing(directory, timeout: float | None = None) -> list[tuple[int, int, str]]:
    """(session, segment, name) of every segment under `directory`, in log order; the
    request cut off after `timeout` seconds (the writer's retry policy) if given."""
    fs, root = storage.filesystem(directory)
    fs.invalidate_cache()  # another process (the run, a resume) may have written since
    try:
        listed = fs.ls(root, detail=False) if timeout is None else \
            storage.run_async(fs, fs._ls(root, detail=False), timeout)
        names = [p.rsplit("/", 1)[-1] for p in listed]
    except FileNotFoundError:
        return []
    found = [(_SEGMENT.match(n), n) for n in names]
    return sorted((int(m.group(1)), int(m.group(2)), n) for m, n in found if m)


def _claim(directory, body: str, base: bool = False, say=None) -> int:
    """Writes `body` as the first segment of a new session (a base segment if `base`) and
    returns its number: one more than the highest listed, or the next free one if another
    writer took that meanwhile."""
    fs, root = storage.filesystem(directory)
    listed = retry.call(lambda timeout: _listing(directory, timeout), f"listing {directory}",
                        say=say)
    session = listed[-1][0] + 1 if listed else 0
    while True:
        head = json.dumps({BASE_KEY: session}) + "\n" if base else ""
        path, blob = f"{root}/{_name(session, 0)}", (head + body).encode()
        try:
            storage.put(directory / _name(session, 0), blob, mode="create", say=say)
            return session
        except FileExistsError:
            # Ours if it holds these very bytes: a create the client retried after its reply
            # was lost. Taking the next number would store the rows twice.
            if fs.cat_file(path) == blob:
                return session
            session += 1


def _write_base(directory, rows: list[dict]) -> int:
    """Phase 1 of a rewrite: `rows` as the base segment of a new session, which supersedes
    every older session; returns its number."""
    return _claim(directory, _jsonl(rows), base=True)


def _drop_superseded(directory, base: int) -> None:
    """Phase 2 of a rewrite: deletes the segments of the sessions below `base`."""
    fs, root = storage.filesystem(directory)
    old = [f"{root}/{name}" for session, _, name in _listing(directory) if session < base]
    if old:
        fs.rm(old)


def _read_remote(directory, say) -> list[dict]:
    for _ in range(_READ_TRIES - 1):
        try:
            return _read_segments(directory, say)
        except FileNotFoundError:  # deleted since listed: a resume rewrote the log; again
            pass
    return _read_segments(directory, say)


def _read_segments(directory, say) -> list[dict]:
    """The rows of the segments from the newest base on, in order."""
    fs, root = storage.filesystem(directory)
    listed = _listing(directory)
    names = {name for _, _, name in listed}
    blobs: dict[str, bytes] = {}
    start = 0
    for session in sorted({s for s, _, _ in listed}, reverse=True):  # find the newest base
        first = _name(session, 0)
        if first not in names:
            continue
        blobs[first] = fs.cat_file(f"{root}/{first}")
        if _header(blobs[first]) is not None:
            start = session
            break
    rest = [f"{root}/{n}" for s, _, n in listed if s >= start and n not in blobs]
    if rest:  # one batch: the filesystem fetches them concurrently
        blobs.update({p.rsplit("/", 1)[-1]: b for p, b in fs.cat(rest).items()})
    rows = []
    for _, _, name in (entry for entry in listed if entry[0] >= start):
        rows.extend(_parse(blobs[name], directory / name, say))
    return rows


def _header(blob: bytes) -> dict | None:
    """The base header of a segment, or None."""
    line = blob.split(b"\n", 1)[0]
    try:
        head = json.loads(line)
    except ValueError:
        return None
    return head if isinstance(head, dict) and BASE_KEY in head else None


def _parse(blob: bytes, where, say) -> list[dict]:
    """A segment's rows; one line and none for a segment that is not whole JSON lines."""
    rows = []
    try:
        lines = blob.decode().split("\n")
    except UnicodeDecodeError:
        say(f"jaxtrain: {where}: not text; segment skipped")
        return []
    if lines[-1]:  # every segment ends with a newline: this one was cut short
        say(f"jaxtrain: {where}: its last line is partial; segment skipped")
        return []
    for number, line in enumerate(lines[:-1], 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            say(f"jaxtrain: {where}: line {number} is not a JSON object; segment skipped")
            return []
        rows.append(row)
    return rows[1:] if _header(blob) is not None else rows
