"""jaxtrain prepare --ray: the parts as tasks on a local Ray cluster (started here, 2 CPUs),
merged to the fingerprint of a one-shot prepare; a failed task retried; a killed driver's
finished parts kept by the rerun."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import ray
from ray import cloudpickle

from jaxtrain.commands import prepare as command
from jaxtrain.errors import DataError
from jaxtrain.prepare import on_ray
from jaxtrain.prepare import pipeline as P

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The flaky and hanging task bodies below are defined here: shipped to Ray's workers by
# value, as the workers cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def inputs(tmp_path):
    """A tiny JSON Lines corpus: each part of two gets records."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {k} " + "word " * (k % 7)}) + "\n"
                            for k in range(40)))
    return [path]


def _request(inputs, out, **more) -> P.Request:
    return P.Request.build(inputs=[str(i) for i in inputs], out=str(out),
                           **{"tokenizer": "bytes", "progress": False, "processes": 1,
                              "unit_bytes": 100, **more})


def _fails_once(request, i, n):
    """Part 1's first attempt dies as a lost connection would; the retry succeeds."""
    marker = f"{request.output.path}.failed-{i}"
    if i == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise ConnectionError("connection reset by the store")
    return on_ray.prepare_part(request, i, n)


@pytest.mark.slow
def test_ray_parts_merge_to_the_one_shot_fingerprint_and_a_failed_task_is_retried(
        cluster, inputs, tmp_path, capsys):
    single = P.prepare(_request(inputs, tmp_path / "single"))
    merged = on_ray.prepare_on_ray(_request(inputs, tmp_path / "ray", progress=True), parts=2,
                                   task=_fails_once)
    assert (tmp_path / "ray.failed-1").exists()  # it did fail once
    assert merged["fingerprint"] == single["fingerprint"]
    assert merged["parts"] == 2 and merged["num_documents"] == 40
    assert "2/2" in capsys.readouterr().err  # the bar counts parts done
    # A user error is not retried: one line naming the part.
    (tmp_path / "bad.jsonl").write_text("{not json\n" * 3)
    with pytest.raises(DataError, match=r"^--ray: part 0/1 failed: .*unusable"):
        on_ray.prepare_on_ray(_request([tmp_path / "bad.jsonl"], tmp_path / "e"), parts=1)


_DRIVER = textwrap.dedent("""
    import sys, time
    from ray import cloudpickle
    from jaxtrain.prepare import on_ray, pipeline as P

    def hangs_on_part_1(request, i, n):
        if i == 1:
            time.sleep(600)
        return on_ray.prepare_part(request, i, n)

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    request = P.Request.build(inputs=[sys.argv[1]], out=sys.argv[2], tokenizer="bytes",
                              progress=False, processes=1, unit_bytes=100)
    on_ray.prepare_on_ray(request, sys.argv[3], parts=2, task=hangs_on_part_1)
""")


@pytest.mark.slow
def test_a_killed_driver_is_resumed_keeping_the_finished_parts(cluster, inputs, tmp_path):
    out = tmp_path / "ray"
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, str(inputs[0]), str(out),
                               cluster], env={**os.environ, "PYTHONPATH": str(ROOT)})
    done = out / "part-00000-of-00002" / "manifest.json"
    try:
        deadline = time.time() + 120
        while not done.exists():
            assert driver.poll() is None and time.time() < deadline, "part 0 never finished"
            time.sleep(0.2)
    finally:
        driver.kill()
        driver.wait()
    first = done.stat().st_mtime_ns
    assert not (out / "manifest.json").exists()  # killed before the merge
    assert command.main([str(inputs[0]), "--out", str(out), "--tokenizer", "bytes", "--ray",
                         "--unit-bytes", "100", "--processes", "1", "--no-progress"]) == 0
    assert done.stat().st_mtime_ns == first  # the finished part was not prepared again
    single = P.prepare(_request(inputs, tmp_path / "single"))
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == \
        single["fingerprint"]


def test_ray_refuses_what_it_cannot_split_and_a_missing_ray_is_one_line(
        inputs, tmp_path, capsys, monkeypatch):
    argv = [str(inputs[0]), "--out", str(tmp_path / "o"), "--ray"]
    assert command.main([*argv, "--train-tokenizer", "300"]) == 2
    assert "--train-tokenizer with --ray" in capsys.readouterr().err
    assert command.main([*argv, "--tokenizer", "bytes", "--shard", "0/2"]) == 2
    assert "give --parts N, not --shard" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    assert command.main([*argv, "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxtrain: error: --ray needs the ray package: pip install "
                   "'jaxtrain[ray]'"]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("address, said", [
    ("127.0.0.1:1", "jaxtrain: error: --ray 127.0.0.1:1: no Ray cluster answers there within "
                    "2s ($JAXTRAIN_RAY_CONNECT_S; ConnectionRefusedError: "),
    ("not-a-host:xx", "jaxtrain: error: --ray not-a-host:xx: not a cluster address; give "
                      "HOST:PORT"),
    ("no-such-host.invalid:6379", "jaxtrain: error: --ray no-such-host.invalid:6379: no Ray "
                                  "cluster answers there within 2s")])
def test_an_address_with_no_cluster_is_one_line_in_bounded_time(
        inputs, tmp_path, capsys, monkeypatch, address, said):
    """The probe's `--ray 127.0.0.1:1` waited over 4 minutes printing Ray's "Failed to
    connect to GCS", and `--ray not-a-host:xx` was a ValueError traceback."""
    monkeypatch.setenv("JAXTRAIN_RAY_CONNECT_S", "2")
    argv = [str(inputs[0]), "--out", str(tmp_path / "o"), "--tokenizer", "bytes",
            "--ray", address]
    assert command.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(said), err
    assert not (tmp_path / "o").exists()
