"""Checkpoints on object storage (jaxtrain/checkpoint_mirror.py), against the real servers:
staged on local disk, mirrored to the bucket with the manifest object last as the commit
marker. Each test gives each "host" its own scratch directory (JAXTRAIN_SCRATCH), so a
restore on another host is one from an empty scratch."""

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
from jaxtrain.checkpoint_mirror import RETRY_ENV, Mirror
from jaxtrain.errors import CheckpointError, ConfigError


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


def test_a_save_restores_on_another_host_and_costs_a_put_per_file_and_manifest(
        bucket, tmp_path, monkeypatch):
    _on_host(monkeypatch, tmp_path, "a")
    saved = _open(bucket)
    _save(saved, 1, 2)
    saved.close()
    files = {step: json.loads((saved.manifests / f"{step}.json").read_text())["files"]
             for step in (1, 2)}
    for step in (1, 2):
        assert _step_objects(bucket, step) == sorted(f"checkpoints/{step}/{name}"
                                                     for name in files[step])
    # The requests a checkpoint costs: one PUT per file, one for its manifest, no more.
    assert saved.mirror.puts == sum(len(f) + 1 for f in files.values())
    assert [p for p in _objects(bucket) if not p.startswith("checkpoints/")] == [
        "checkpoint_manifests/1.json", "checkpoint_manifests/2.json"]

    _on_host(monkeypatch, tmp_path, "b")
    restored = _open(bucket)
    assert restored.steps() == [1, 2]
    assert _restored_step(restored) == 2
    assert sorted(p.name for p in restored.staging.iterdir()) == ["2"]  # only what it read
    restored.close()

    # A reader (eval, generate) downloads only the step it reads, and writes nothing there.
    before = _objects(bucket)
    _on_host(monkeypatch, tmp_path, "c")
    reader = _open(bucket, read_only=True)
    assert reader.latest_intact() == (2, {"step": 2})
    params = reader.restore_params(2, _target()["params"])
    np.testing.assert_array_equal(params["w"], _tree(2)["params"]["w"])
    reader.manager.close()
    assert sorted(p.name for p in reader.staging.iterdir()) == ["2"]
    assert _objects(bucket) == before


def test_a_kill_at_each_stage_of_an_upload(bucket, tmp_path, monkeypatch):
    """Steps 1-3 committed on host a's disk; then a kill after step 1's manifest (committed),
    after step 2's files but before its manifest, and before step 3's upload began."""
    _on_host(monkeypatch, tmp_path, "a")
    remote = storage.as_path(f"{bucket}/run") / "checkpoints"
    staging = storage.scratch_dir(remote, "checkpoints")
    manifests = storage.scratch_dir(remote, "checkpoint_manifests")
    local = Checkpoints(staging, keep=10, manifests=manifests)  # the staged half alone
    _save(local, 1, 2, 3)
    local.close()
    mirror = Mirror(remote, remote.parent / "checkpoint_manifests")
    put_manifest = mirror.put_manifest

    def manifest_last(step, data):  # the order: every file is there before the manifest
        assert len(_step_objects(bucket, step)) == len(json.loads(data)["files"])
        put_manifest(step, data)
    mirror.put_manifest = manifest_last
    for step in (1, 2):
        data = (manifests / f"{step}.json").read_bytes()
        mirror.put_files(step, staging / str(step), json.loads(data)["files"])
        if step == 1:
            mirror.put_manifest(step, data)
    assert _step_objects(bucket, 2)

    _on_host(monkeypatch, tmp_path, "b")
    lines = []
    other = _open(bucket, lines)
    assert other.steps() == [1], "an upload without its manifest is never listed"
    assert not _step_objects(bucket, 2), "and is deleted when a run starts"
    assert lines == [f"jaxtrain: deleted checkpoint step 2 from {remote}: its upload did not "
                     "finish (no manifest)"]
    assert _restored_step(other) == 1
    other.close()

    _on_host(monkeypatch, tmp_path, "a")  # the host that has them resumes and uploads them
    same = _open(bucket)
    assert same.steps() == [1, 2, 3]
    same.wait()
    assert [p for p in _objects(bucket) if p.startswith("checkpoint_manifests/")] == [
        f"checkpoint_manifests/{s}.json" for s in (1, 2, 3)]
    assert _restored_step(same) == 3
    same.close()


def test_a_damaged_remote_step_falls_back_and_is_set_aside_in_the_bucket(
        bucket, tmp_path, monkeypatch):
    _on_host(monkeypatch, tmp_path, "a")
    _save(_open(bucket), 1, 2, 3)
    fs, root = storage.filesystem(f"{bucket}/run/checkpoints")
    for step, damage in ((3, lambda b: b[:-5]), (2, lambda b: bytes([b[0] ^ 0xFF]) + b[1:])):
        data_file = max(_step_objects(bucket, step), key=lambda p: len(p))
        path = f"{root}/{data_file.split('/', 1)[1]}"
        fs.pipe_file(path, damage(fs.cat_file(path)))

    _on_host(monkeypatch, tmp_path, "b")
    lines = []
    fresh = _open(bucket, lines)
    assert _restored_step(fresh) == 1
    assert len(lines) == 2
    assert "checkpoint step 3 in" in lines[0] and "is truncated" in lines[0]
    assert "checkpoint step 2 in" in lines[1] and "has changed" in lines[1]
    assert f"moved to {bucket}/run/checkpoints_damaged/3-" in lines[0]
    assert fresh.steps() == [1]
    objects = _objects(bucket)
    assert not [p for p in objects if p.startswith(("checkpoints/2/", "checkpoints/3/"))]
    assert "checkpoint_manifests/2.json" not in objects
    for step in (2, 3):
        assert [p for p in objects if p.startswith(f"checkpoints_damaged/{step}-")]
    fresh.close()

    # Back on host a: its copies of the steps set aside are dropped, and a bad copy of step 1
    # on its disk is replaced by the bucket's, not taken for damage of the step.
    _on_host(monkeypatch, tmp_path, "a")
    staged = storage.scratch_dir(storage.as_path(f"{bucket}/run") / "checkpoints",
                                 "checkpoints")
    local_file = max((p for p in (staged / "1").rglob("*") if p.is_file()),
                     key=lambda p: p.stat().st_size)
    local_file.write_bytes(b"\0" * local_file.stat().st_size)
    lines.clear()
    again = _open(bucket, lines)
    assert sorted(p.name for p in staged.iterdir()) == ["1"]
    assert _restored_step(again) == 1 and lines == []
    assert _objects(bucket) == objects
    again.close()


def test_rotation_and_health_marks_reach_the_bucket(bucket, tmp_path, monkeypatch):
    _on_host(monkeypatch, tmp_path, "a")
    checkpoints = _open(bucket, keep=1)
    for step in (1, 2, 3):
        _save(checkpoints, step)
        checkpoints.mark_healthy(step)
    checkpoints.close()
    objects = _objects(bucket)
    assert {p.split("/")[1] for p in objects} == {"3", "3.json"}
    fs, _ = storage.filesystem(bucket)
    assert json.loads(fs.cat_file(f"{bucket}/run/checkpoint_manifests/3.json"))["healthy"]
    _on_host(monkeypatch, tmp_path, "b")
    fresh = _open(bucket, keep=1)
    assert fresh.steps() == [3] and fresh.healthy == {3}
    fresh.close()


def test_an_outage_during_an_upload_is_retried_and_the_upload_completes(
        bucket, tmp_path, monkeypatch):
    server = object_server(bucket.split("://")[0])
    _on_host(monkeypatch, tmp_path, "a")
    lines = []
    checkpoints = _open(bucket, lines)
    server.proxy.delay_s = 0.05  # ~1 s for the step's objects: the outage comes among them
    checkpoints.save(1, _tree(1), {"step": 1})
    deadline = time.monotonic() + 30
    while not checkpoints._manifest_path(1).exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # committed here: the upload starts now
    time.sleep(0.05)
    assert checkpoints.mirror.puts == 0, "the outage comes before the upload is done"
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
    assert lines[0].startswith(f"jaxtrain: checkpoint step 2 could not be uploaded to {remote}: ")
    assert lines[0].endswith("; the run goes on, step 2 stays local only")

    _on_host(monkeypatch, tmp_path, "b")
    fresh = _open(bucket)
    assert fresh.steps() == [1]
    server.proxy.down()  # a restore that cannot download: one line, nothing set aside
    try:
        with pytest.raises(CheckpointError, match=r"download of step 1 failed .*retried for "
                                                  r"1 s$"):
            _restored_step(fresh)
    finally:
        server.proxy.up()
    assert fresh.steps() == [1]
    assert _restored_step(fresh) == 1
    fresh.close()
    assert not [p for p in _objects(bucket) if p.startswith("checkpoints_damaged")]

    # Host a goes on: the next save uploads step 2 too. With the server back, the 1 s budget
    # that made the outages quick would fail a slow upload on a loaded machine (CI once).
    checkpoints.mirror.budget_s = 120
    _save(checkpoints, 3)
    assert [p for p in _objects(bucket) if p.startswith("checkpoint_manifests/")] == [
        f"checkpoint_manifests/{s}.json" for s in (1, 2, 3)]
    checkpoints.close()


def test_a_missing_bucket_is_a_one_line_error(
        bucket, tmp_path, monkeypatch):
    _on_host(monkeypatch, tmp_path, "a")
    scheme = bucket.split("://")[0]
    with pytest.raises(ConfigError, match=rf"^checkpoints={scheme}://jt-missing/run/"
                                          "checkpoints: bucket jt-missing does not exist$"):
        Checkpoints(storage.as_path(f"{scheme}://jt-missing/run/checkpoints"), keep=1)
