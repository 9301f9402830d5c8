"""The run's outbox (jaxtrain/outbox.py) against a store that does not answer (the proxy of
tests/servers.py refusing connections): nothing waits on the caller's thread, one copy of
each whole object is held, the bound stops the run with what waited kept, and the final
wait ends with what was not written kept on the scratch disk and named."""

import json
import pathlib
import re
import time

import pytest
from conftest import object_server

from jaxtrain import storage
from jaxtrain.errors import StoreUnavailable
from jaxtrain.metrics_log import MetricsLog, read_metrics
from jaxtrain.outbox import Outbox


@pytest.fixture
def store_down(bucket, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXTRAIN_STORAGE_RETRY_S", "0.5")
    monkeypatch.setenv("JAXTRAIN_SCRATCH", str(tmp_path / "scratch"))
    proxy = object_server(storage.scheme_of(bucket)).proxy
    proxy.down()
    yield storage.as_path(bucket) / "run"
    proxy.up()


def _kept(message: str) -> pathlib.Path:
    return pathlib.Path(re.search(r"kept in (\S+?);", message)[1])


def test_the_final_wait_keeps_what_was_not_written_and_names_it(store_down):
    workdir, said = store_down, []
    outbox = Outbox(workdir, said.append)
    log = MetricsLog(workdir, say=said.append, outbox=outbox)
    for step in range(3):
        log.write({"step": step, "loss": 1.5})
        outbox.put(workdir / "goodput.json", json.dumps({"step": step}))
    began = time.monotonic()
    log.close()  # hands the rows to the outbox: nothing waits on this thread
    assert time.monotonic() - began < 5
    assert len(outbox.jobs) <= 3, "one copy of goodput.json waits, however many puts"
    with pytest.raises(StoreUnavailable) as stopped:
        outbox.close(final_s=1.5)
    message = str(stopped.value)
    assert message.startswith(f"the store did not take the run's last writes to {workdir} "
                              "within 1.5s ($JAXTRAIN_STORAGE_FINAL_S): "), message
    assert "\n" not in message and stopped.value.exit_code == 75
    kept = _kept(message)
    assert json.loads((kept / "goodput.json").read_text()) == {"step": 2}, "the newest"
    rows = [json.loads(line) for f in sorted((kept / "metrics").iterdir())
            for line in f.read_text().splitlines()]
    assert rows == [{"step": s, "loss": 1.5} for s in range(3)]
    assert any("still trying (waiting up to 1.5s ($JAXTRAIN_STORAGE_FINAL_S))" in line
               for line in said) or any("could not store" in line for line in said), said


def test_the_bound_stops_the_run_with_what_waited_kept(store_down, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_OUTBOX_MB", "0.001")  # about a kilobyte
    workdir = store_down
    outbox = Outbox(workdir, lambda line: None)
    log = MetricsLog(workdir, flush_s=0.0, outbox=outbox)  # a segment per row
    with pytest.raises(StoreUnavailable) as stopped:
        for step in range(100):
            log.write({"step": step, "loss": 1.5, "note": "x" * 40})
    message = str(stopped.value)
    assert "reached 0.001 MiB ($JAXTRAIN_OUTBOX_MB)" in message and message.endswith(
        "copy it there once the store answers; stopped"), message
    kept = _kept(message)
    steps = [json.loads(line)["step"] for f in (kept / "metrics").iterdir()
             for line in f.read_text().splitlines()]
    assert steps and max(steps) == len(steps) - 1 + min(steps), "every row not stored kept"
    outbox.close()  # stopped already: no wait


def test_rows_wait_for_a_store_that_comes_back(bucket, monkeypatch):
    """Past the retry budget the rows wait in memory, in order, and reach the store once it
    answers, with the outage's end said."""
    monkeypatch.setenv("JAXTRAIN_STORAGE_RETRY_S", "0.5")
    workdir, said = storage.as_path(bucket) / "run", []
    outbox = Outbox(workdir, said.append)
    log = MetricsLog(workdir, say=said.append, outbox=outbox)
    proxy = object_server(storage.scheme_of(bucket)).proxy
    proxy.down()
    try:
        for step in range(4):
            log.write({"step": step})
            log.flush()
        assert outbox.sync(30)  # each tried once: a whole budget
        assert [line for line in said if "could not store" in line], said
    finally:
        proxy.up()
    log.close()
    outbox.close(final_s=60)
    assert read_metrics(workdir) == [{"step": s} for s in range(4)]
    assert any(line.startswith("jaxtrain: stored ") and line.endswith("the store answers again")
               for line in said), said
