"""The metrics log (jaxtrain/metrics_log.py): metrics.jsonl on disk, segment objects on the
object-storage servers tests/servers.py starts on 127.0.0.1."""

import json
import threading
import time

from conftest import small_config

from jaxtrain import metrics_log, storage
from jaxtrain.metrics_log import MetricsLog, keep_metrics_up_to, read_metrics


def _rows(steps, **extra):
    return [{"step": s, "loss": 1.0 / (s + 1), **extra} for s in steps]


def _write(workdir, rows, flush_every: int = 0):
    log = MetricsLog(workdir)
    for i, row in enumerate(rows, 1):
        log.write(row)
        if flush_every and i % flush_every == 0:
            log.flush()
    log.close()


def _segments(workdir) -> list[str]:
    return [name for _, _, name in metrics_log._listing(metrics_log.location(workdir))]


def test_two_sessions_with_flushes_read_back_in_order(bucket):
    workdir = storage.as_path(bucket) / "run"
    assert read_metrics(workdir) == []
    first, second = _rows(range(1, 8)), _rows(range(8, 12))
    _write(workdir, first, flush_every=3)  # segments of 3, 3 and 1 rows (close flushes)
    _write(workdir, second)
    assert read_metrics(workdir) == first + second
    assert _segments(workdir) == ["00000000-000000.jsonl", "00000000-000001.jsonl",
                                  "00000000-000002.jsonl", "00000001-000000.jsonl"]


def test_rows_are_stored_at_flush_and_by_time(bucket):
    workdir = storage.as_path(bucket) / "run"
    log = MetricsLog(workdir)
    log.write(_rows([1])[0])
    log.flush()
    log.flush()  # nothing new: no segment
    log.write(_rows([2])[0])
    assert log.sync(30)  # the writer thread stored what was flushed
    assert read_metrics(workdir) == _rows([1])  # the second row is not stored yet
    log.flush_s = 0.0  # the time between segments is up: the next row writes one
    log.write(_rows([3])[0])
    assert log.sync(30)
    assert read_metrics(workdir) == _rows([1, 2, 3])
    log.close()
    assert len(_segments(workdir)) == 2


def test_a_taken_session_number_goes_to_the_next(bucket, monkeypatch):
    workdir = storage.as_path(bucket) / "run"
    first, second = MetricsLog(workdir), MetricsLog(workdir)
    first.write(_rows([1])[0])
    second.write(_rows([2])[0])
    # Each lists before the other creates: both try session 0, and the create decides.
    monkeypatch.setattr(metrics_log, "_listing", lambda directory, timeout=None: [])
    first.flush()
    assert first.sync(30)
    second.flush()
    assert second.sync(30)
    # A create retried after its reply was lost finds its own bytes: the same session.
    again = metrics_log._claim(metrics_log.location(workdir), json.dumps(_rows([1])[0]) + "\n")
    monkeypatch.undo()
    assert (first.segments.session, second.segments.session, again) == (0, 1, 0)
    assert read_metrics(workdir) == _rows([1, 2])


def test_resume_keeps_rows_up_to_the_step_through_a_crash_between_phases(bucket):
    workdir = storage.as_path(bucket) / "run"
    directory = metrics_log.location(workdir)
    _write(workdir, _rows(range(1, 6)), flush_every=2)
    _write(workdir, _rows(range(6, 10)), flush_every=2)
    assert read_metrics(workdir) == _rows(range(1, 10))
    # Resuming at step 7, killed after phase 1 (the base) and before phase 2 (deleting):
    # the rows up to 7 are read once, the older segments ignored.
    base = metrics_log._write_base(directory, _rows(range(1, 8)))
    assert len(_segments(workdir)) == 6
    assert read_metrics(workdir) == _rows(range(1, 8))
    # The next resume rewrites again, over the base and what the crash left.
    keep_metrics_up_to(workdir, 7)
    assert read_metrics(workdir) == _rows(range(1, 8))
    assert _segments(workdir) == [f"{base + 1:08d}-000000.jsonl"]
    _write(workdir, _rows(range(8, 11)))
    keep_metrics_up_to(workdir, 9)
    assert read_metrics(workdir) == _rows(range(1, 10))
    keep_metrics_up_to(workdir, 0)  # a run that starts afresh keeps none
    assert read_metrics(workdir) == []


def test_a_garbage_segment_is_named_and_skipped(bucket):
    workdir = storage.as_path(bucket) / "run"
    directory = metrics_log.location(workdir)
    _write(workdir, _rows([1, 2]))
    _write(workdir, _rows([3]))
    storage.atomic_write(directory / "00000000-000001.jsonl", b'{"step": 2, "lo')
    storage.atomic_write(directory / "00000001-000001.jsonl", b'not json\n')
    storage.atomic_write(directory / "notes.txt", b"ignored")
    said = []
    assert read_metrics(workdir, said.append) == _rows([1, 2, 3])
    assert said == [
        f"jaxtrain: {directory / '00000000-000001.jsonl'}: its last line is partial; "
        "segment skipped",
        f"jaxtrain: {directory / '00000001-000001.jsonl'}: line 1 is not a JSON object; "
        "segment skipped"]
    keep_metrics_up_to(workdir, 9, said.append)  # the rewrite drops them
    assert read_metrics(workdir) == _rows([1, 2, 3])
    assert len(said) == 4


def test_local_log_is_metrics_jsonl_as_before(tmp_path):
    assert metrics_log.location(tmp_path) == tmp_path / "metrics.jsonl"
    log = MetricsLog(tmp_path, flush_s=1e9)
    log.write({"step": 1, "loss": 0.1})
    # On disk when write returns, one whole line per row, whatever flush_s says.
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.1}\n'
    log.write({"step": 2, "loss": 0.2})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # a run killed mid-write
    said = []
    keep_metrics_up_to(tmp_path, 2, said.append)
    assert said == [f"jaxtrain: {tmp_path / 'metrics.jsonl'}: its last line is partial (a run "
                    "stopped while writing it); dropped"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 0.1},
                                                    {"step": 2, "loss": 0.2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_nothing_logged_is_nothing_kept(bucket, tmp_path):
    for workdir in (tmp_path, storage.as_path(bucket) / "run"):
        keep_metrics_up_to(workdir, 3)
        assert read_metrics(workdir) == []
        assert not metrics_log.location(workdir).exists()


def test_a_read_during_a_rewrite_reads_again(bucket, monkeypatch):
    workdir = storage.as_path(bucket) / "run"
    directory = metrics_log.location(workdir)
    _write(workdir, _rows(range(1, 5)), flush_every=2)
    stale = metrics_log._listing(directory)
    keep_metrics_up_to(workdir, 3)  # a resume in another process deletes what was listed
    listings = iter([stale])
    listing = metrics_log._listing
    monkeypatch.setattr(metrics_log, "_listing",
                        lambda d, timeout=None: next(listings, None) or listing(d))
    assert read_metrics(workdir) == _rows(range(1, 4))


def test_the_loops_writer_stores_its_rows_on_flush(bucket):
    """MetricsWriter.flush (what Checkpointer.save calls before a save) reaches the log."""
    from jaxtrain.metrics import MetricsWriter

    workdir = storage.as_path(bucket) / "run"
    writer = MetricsWriter(workdir, 10, 0, cfg=small_config(**{"metrics.sinks": "jsonl"}))
    writer.write(1, {"step": 1, "loss": 2.5})
    assert read_metrics(workdir) == []
    writer.flush()
    assert writer.sync(30)  # the flush itself returns at once: a writer thread stores them
    assert read_metrics(workdir) == [{"step": 1, "loss": 2.5}]
    writer.write(2, {"loss": 2.25})
    writer.close()
    assert read_metrics(workdir) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]


# -- a flaky store (the proxy refuses connections; the server paused): the writer thread -----


def _server_of(bucket):
    from conftest import object_server
    return object_server(storage.scheme_of(bucket))


def _threads_that_store(monkeypatch) -> list[str]:
    """The names of the threads that write segments to the store, one per attempt: that
    the caller is never among them is what "never waits on the store" means, whatever the
    host's timing."""
    names: list[str] = []
    store = metrics_log.SegmentWriter._store

    def recorded(self, blob):
        names.append(threading.current_thread().name)
        return store(self, blob)

    monkeypatch.setattr(metrics_log.SegmentWriter, "_store", recorded)
    return names


def test_an_outage_during_a_flush_costs_no_row_and_no_wait(bucket, monkeypatch):
    """Checkpointing.save -> flush on the training thread: the store refusing connections
    for 2 s (within the retry budget) neither raises nor holds the caller, and every row is
    stored once it is back."""
    monkeypatch.setenv("JAXTRAIN_STORAGE_RETRY_S", "30")
    storers = _threads_that_store(monkeypatch)
    workdir = storage.as_path(bucket) / "run"
    said = []
    log = MetricsLog(workdir, say=said.append)
    log.write(_rows([1])[0])
    log.flush()
    assert log.sync(30)
    proxy = _server_of(bucket).proxy
    proxy.down()
    try:
        for row in _rows([2, 3]):
            log.write(row)
        log.flush()
        time.sleep(2.0)  # the outage
        assert not log.sync(0)  # rows 2-3 still wait: the store did refuse them
    finally:
        proxy.up()
    assert log.sync(60)
    log.close()
    assert read_metrics(workdir) == _rows([1, 2, 3])
    assert len(storers) == 2 and threading.current_thread().name not in storers, storers
    assert not [line for line in said if "could not store" in line], said


def test_an_outage_past_the_budget_is_one_line_and_the_rows_go_out_later(bucket, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_STORAGE_RETRY_S", "1")
    workdir = storage.as_path(bucket) / "run"
    said = []
    log = MetricsLog(workdir, say=said.append)
    proxy = _server_of(bucket).proxy
    proxy.down()
    try:
        log.write(_rows([1])[0])
        log.flush()
        assert log.sync(60)
    finally:
        proxy.up()
    failed = [line for line in said if "could not store" in line]
    assert len(failed) == 1 and "\n" not in failed[0], said
    assert failed[0].startswith(f"jaxtrain: could not store 1 metrics rows in {workdir}/metrics (")
    assert failed[0].endswith("retried for 1s ($JAXTRAIN_STORAGE_RETRY_S)); kept in memory and "
                              "written when the store answers")
    log.write(_rows([2])[0])
    log.close()
    assert read_metrics(workdir) == _rows([1, 2])


def test_a_stall_is_reported_while_the_training_thread_goes_on(bucket, monkeypatch):
    """The issue's 150 s SIGSTOP of the server, scaled to 3 s with a 0.5 s stall report:
    the writes of the training thread never wait, the stall is said while it lasts (the
    store's URL and how long), and the rows are stored after it."""
    monkeypatch.setenv("JAXTRAIN_STORAGE_STALL_S", "0.5")
    monkeypatch.setenv("JAXTRAIN_STORAGE_RETRY_S", "60")
    storers = _threads_that_store(monkeypatch)
    workdir = storage.as_path(bucket) / "run"
    said = []
    log = MetricsLog(workdir, flush_s=0.2, say=said.append)
    log.write(_rows([0])[0])
    log.flush()
    assert log.sync(30)
    server = _server_of(bucket)
    server.pause()
    trained = {"steps": 1}

    def train():  # the training thread: a row every 50 ms for 3 s
        began = time.monotonic()
        while time.monotonic() - began < 3.0:
            log.write(_rows([trained["steps"]])[0])  # flushes by time (flush_s) on its own
            trained["steps"] += 1
            time.sleep(0.05)

    trainer = threading.Thread(target=train, name="trainer", daemon=True)
    try:
        trainer.start()
        trainer.join(10)  # the server stays paused all along
        went_on = not trainer.is_alive()
        heard = [line for line in said if "has not answered" in line]
    finally:
        server.resume()
    trainer.join(60)
    step = trained["steps"]
    # It finished while the store was still paused, and it never wrote to the store itself.
    assert went_on, "the training thread waited on the paused store"
    assert heard, said  # said during the stall, not after it
    assert heard[0].startswith(f"jaxtrain: writing {workdir}/metrics: "
                               "the store has not answered for "), heard[0]
    log.close()
    assert read_metrics(workdir) == _rows(range(step))
    assert storers and "trainer" not in storers, storers
    assert not [line for line in said if "could not store" in line], said
