"""Checkpoints on object storage (jaxtrain/checkpoint_remote.py), against the real servers:
each step written in place through the shard store (jaxtrain/checkpoint_shards.py), its
commit marker last. Each test gives each "host" its own scratch directory (JAXTRAIN_SCRATCH),
so a restore on another host is one from an empty scratch, and nothing may land there."""

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import object_server

from jaxtrain import storage
from jaxtrain.checkpoint import Checkpoints
from jaxtrain.errors import CheckpointError, ConfigError
from jaxtrain.retry import RETRY_ENV

STEP_OBJECTS = ["commit.json", "state.p0.0.bin", "state.p0.json"]


def _tree(step: int) -> dict:
    return {"params": {"w": jnp.arange(6.0).reshape(2, 3) + step, "b": jnp.full(3, step / 2)},
            "step": jnp.int32(step)}


def _target() -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        _tree(0))


def _on_host(monkeypatch, tmp_path, name: str) -> None:
    """What follows runs on host `name`: its own, initially empty, scratch directory."""
    monkeypatch.setenv("JAXTRAIN_SCRATCH", str(tmp_path / name))


def _open(bucket, lines=None, **kwargs) -> Checkpoints:
    log = (lines.append if lines is not None else lambda _: None)
    return Checkpoints(storage.as_path(f"{bucket}/run") / "checkpoints",
                       kwargs.pop("keep", 10), log=log, **kwargs)


def _save(checkpoints: Checkpoints, *steps: int) -> None:
    for step in steps:
        checkpoints.save(step, _tree(step), {"step": step})
    checkpoints.wait()


def _objects(bucket) -> list[str]:
    """Every object under the run's prefix, relative to it."""
    fs, root = storage.filesystem(f"{bucket}/run")
    fs.invalidate_cache()
    return sorted(path[len(root) + 1:] for path in fs.find(root))


def _step_objects(bucket, step: int) -> list[str]:
    return [p for p in _objects(bucket) if p.startswith(f"checkpoints/{step}/")]


def _restored_step(checkpoints: Checkpoints) -> int:
    step, tree, saved, _ = checkpoints.newest_intact(_target(), lambda *_: None)
    np.testing.assert_array_equal(tree["params"]["w"], _tree(step)["params"]["w"])
    assert saved == {"step": step}
    return step


def _files(tmp_path, host: str) -> list:
    """Every file on host `host`'s disk (its scratch directory)."""
    return [p for p in (tmp_path / host).rglob("*") if p.is_file()]


def _writes(server, bucket) -> int:
    """The write requests to `bucket` the server has had so far (S3: PUT; GCS: POST
    uploads), not those of a background writer an earlier test left on the same server."""
    name = bucket.split("://", 1)[1].split("/", 1)[0]
    return sum(1 for line in list(server.proxy.lines)
               if line.split(" ")[0] in ("PUT", "POST") and f"/{name}/" in line + "/")


def test_a_save_restores_on_another_host_and_costs_three_objects(bucket, tmp_path,
                                                                  monkeypatch):
    server = object_server(bucket.split("://")[0])
    _on_host(monkeypatch, tmp_path, "a")
    saved = _open(bucket)
    before = _writes(server, bucket)
    _save(saved, 1, 2)
    # The requests a checkpoint costs: its part, its index and its marker, no more.
    assert _writes(server, bucket) - before == 2 * len(STEP_OBJECTS)
    saved.close()
    for step in (1, 2):
        assert _step_objects(bucket, step) == [f"checkpoints/{step}/{n}" for n in STEP_OBJECTS]
    assert [p for p in _objects(bucket) if not p.startswith("checkpoints/")] == []
    assert _files(tmp_path, "a") == [], "nothing of a step on the saving host's disk"

    _on_host(monkeypatch, tmp_path, "b")
    restored = _open(bucket)
    assert restored.steps() == [1, 2]
    assert _restored_step(restored) == 2
    restored.close()
    assert _files(tmp_path, "b") == [], "read in place: no copy on the restoring host"

    # A reader (eval, generate) reads in place too, and writes nothing anywhere.
    before = _objects(bucket)
    _on_host(monkeypatch, tmp_path, "c")
    reader = _open(bucket, read_only=True)
    assert reader.latest_intact() == (2, {"step": 2})
    params = reader.restore_params(2, _target()["params"])
    np.testing.assert_array_equal(params["w"], _tree(2)["params"]["w"])
    reader.close()
    assert _files(tmp_path, "c") == []
    assert _objects(bucket) == before


def test_a_kill_at_each_stage_of_a_save(bucket, tmp_path, monkeypatch):
    """Step 1 committed; step 2 killed after its part and index, before its marker; step 3
    killed before anything was written. A run on another host sees step 1 only, and deletes
    what step 2 left."""
    _on_host(monkeypatch, tmp_path, "a")
    checkpoints = _open(bucket)
    _save(checkpoints, 1, 2)
    checkpoints.close()
    storage.kvstore(f"{bucket}/run/checkpoints/2").write("commit.json", None).result()
    assert _step_objects(bucket, 2) == ["checkpoints/2/state.p0.0.bin",
                                        "checkpoints/2/state.p0.json"]

    _on_host(monkeypatch, tmp_path, "b")
    lines = []
    other = _open(bucket, lines)
    remote = storage.as_path(f"{bucket}/run") / "checkpoints"
    assert other.steps() == [1], "a save without its marker is never listed"
    assert not _step_objects(bucket, 2), "and is deleted when a run starts"
    assert lines == [f"jaxtrain: deleted checkpoint step {2} from {remote}: its save did "
                     "not finish (no commit marker)"]
    assert _restored_step(other) == 1
    _save(other, 2, 3)  # the run goes on and saves them again
    other.close()
    assert _open(bucket).steps() == [1, 2, 3]


def test_a_damaged_remote_step_falls_back_and_is_set_aside_in_the_bucket(
        bucket, tmp_path, monkeypatch):
    _on_host(monkeypatch, tmp_path, "a")
    _save(_open(bucket), 1, 2, 3)
    for step, damage in ((3, lambda b: b[:-5]), (2, lambda b: bytes([b[0] ^ 0xFF]) + b[1:])):
        store = storage.kvstore(f"{bucket}/run/checkpoints/{step}")
        store.write("state.p0.0.bin", damage(store.read("state.p0.0.bin").result().value)
                    ).result()

    _on_host(monkeypatch, tmp_path, "b")
    lines = []
    fresh = _open(bucket, lines)
    assert _restored_step(fresh) == 1
    assert len(lines) == 2
    assert "checkpoint step 3 in" in lines[0] and "cannot be read" in lines[0]
    assert "checkpoint step 2 in" in lines[1] and "has changed" in lines[1]
    assert f"moved to {bucket}/run/checkpoints_damaged/3-" in lines[0]
    assert fresh.steps() == [1]
    objects = _objects(bucket)
    assert not [p for p in objects if p.startswith(("checkpoints/2/", "checkpoints/3/"))]
    for step in (2, 3):  # kept whole, never deleted
        assert sorted(p.split("/", 2)[2] for p in objects
                      if p.startswith(f"checkpoints_damaged/{step}-")) == STEP_OBJECTS
    fresh.close()
    assert _files(tmp_path, "b") == []


def test_rotation_and_health_marks_reach_the_bucket(bucket, tmp_path, monkeypatch):
    _on_host(monkeypatch, tmp_path, "a")
    checkpoints = _open(bucket, keep=1)
    for step in (1, 2, 3):
        _save(checkpoints, step)
        checkpoints.mark_healthy(step)
    checkpoints.close()
    assert {p.split("/")[1] for p in _objects(bucket)} == {"3"}
    marker = storage.kvstore(f"{bucket}/run/checkpoints/3").read("commit.json").result()
    assert json.loads(marker.value)["healthy"]
    _on_host(monkeypatch, tmp_path, "b")
    fresh = _open(bucket, keep=1)
    assert fresh.steps() == [3] and fresh.healthy == {3}
    fresh.close()


def test_an_outage_during_a_save_is_retried_and_the_save_completes(
        bucket, tmp_path, monkeypatch):
    server = object_server(bucket.split("://")[0])
    _on_host(monkeypatch, tmp_path, "a")
    lines = []
    checkpoints = _open(bucket, lines)
    server.proxy.delay_s = 0.05  # its 3 objects take > 0.15 s: the outage comes among them
    checkpoints.save(1, _tree(1), {"step": 1})
    time.sleep(0.05)
    assert checkpoints.steps() == [], "the outage comes before the save is done"
    server.proxy.down()
    threading.Timer(1.0, server.proxy.up).start()
    checkpoints.wait()
    assert checkpoints.steps() == [1] and lines == []
    checkpoints.close()
    server.proxy.delay_s = 0.0
    _on_host(monkeypatch, tmp_path, "b")
    fresh = _open(bucket)
    assert _restored_step(fresh) == 1
    fresh.close()


def test_a_server_down_for_good_says_so_in_one_line_and_keeps_the_previous_step(
        bucket, tmp_path, monkeypatch):
    server = object_server(bucket.split("://")[0])
    monkeypatch.setenv(RETRY_ENV, "1")
    _on_host(monkeypatch, tmp_path, "a")
    lines = []
    checkpoints = _open(bucket, lines)
    _save(checkpoints, 1)
    server.proxy.down()
    try:
        _save(checkpoints, 2)
    finally:
        server.proxy.up()
    remote = storage.as_path(f"{bucket}/run") / "checkpoints"
    assert len(lines) == 1
    assert lines[0].startswith(f"jaxtrain: checkpoint step 2 could not be saved to {remote}: ")
    assert lines[0].endswith("; the run goes on without it")

    _on_host(monkeypatch, tmp_path, "b")
    fresh = _open(bucket)
    assert fresh.steps() == [1]
    server.proxy.down()  # a restore that cannot read: one line, nothing set aside
    try:
        with pytest.raises(CheckpointError, match=r"checkpoint step 1 in .* could not be "
                                                  r"read: .*retried for 1s"):
            _restored_step(fresh)
    finally:
        server.proxy.up()
    assert fresh.steps() == [1]
    assert _restored_step(fresh) == 1
    fresh.close()
    assert not [p for p in _objects(bucket) if p.startswith("checkpoints_damaged")]

    # Host a goes on: its next save is committed. With the server back, the 1 s budget that
    # made the outages quick would fail a slow write on a loaded machine.
    monkeypatch.setenv(RETRY_ENV, "120")
    _save(checkpoints, 3)
    assert checkpoints.steps() == [1, 3]
    checkpoints.close()
    assert _open(bucket).steps() == [1, 3]


def test_a_missing_bucket_is_a_one_line_error(
        bucket, tmp_path, monkeypatch):
    _on_host(monkeypatch, tmp_path, "a")
    scheme = bucket.split("://")[0]
    with pytest.raises(ConfigError, match=rf"^checkpoints={scheme}://jt-missing/run/"
                                          "checkpoints: bucket jt-missing does not exist$"):
        Checkpoints(storage.as_path(f"{scheme}://jt-missing/run/checkpoints"), keep=1)
