"""Profiling, the data-wait split, warnings and the PNG report."""

import json

import pytest
from conftest import small_config

from jaxtrain.commands import report
from jaxtrain.train.loop import run


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, devices):
    workdir = tmp_path_factory.mktemp("profiled")
    cfg = small_config(**{"steps": 8, "log_every_steps": 2, "eval_every_steps": 4,
                          "profile.start_step": 3, "profile.num_steps": 2,
                          "train.mfu_floor": 0.999})
    return workdir, run(cfg, workdir, devices[:1])


def test_profile_window_writes_a_trace_and_memory_profile(profiled_run):
    workdir, _ = profiled_run
    assert list((workdir / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert (workdir / "profile" / "memory.prof").stat().st_size > 0


def test_step_time_splits_into_data_wait_and_device_time(profiled_run):
    _, rows = profiled_run
    for row in rows:
        assert 0 <= row["data_wait_s"] <= row["step_time_s"]
        assert row["device_time_s"] == pytest.approx(row["step_time_s"] - row["data_wait_s"])


def test_mfu_floor_warns_once(tmp_path, devices, capfd):
    cfg = small_config(**{"steps": 6, "log_every_steps": 2, "train.mfu_floor": 0.999})
    run(cfg, tmp_path, devices[:1])
    err = capfd.readouterr().err
    assert err.count("is under train.mfu_floor=0.999; profile it with") == 1


def test_report_draws_a_png_and_summarises(profiled_run, capsys):
    workdir, rows = profiled_run
    report.main(["--workdir", str(workdir)])
    out = capsys.readouterr().out
    png = (workdir / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "steps logged: 4, last step 8" in out
    val = [json.loads(row)["val_loss"]
           for row in (workdir / "metrics.jsonl").read_text().splitlines() if "val_loss" in row]
    assert f"val_loss: first {val[0]:.4f}, last {val[-1]:.4f}" in out


def test_report_on_a_missing_run_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        report.main(["--workdir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "metrics.jsonl does not exist; is --workdir a jaxtrain run" in capsys.readouterr().err


@pytest.mark.parametrize("device_kind,entry", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA H200", "H200"), ("TPU v5 lite", "TPU-v5e"), ("TPU v5p", "TPU-v5p")])
def test_mfu_peak_comes_from_the_hardware_catalog(device_kind, entry, monkeypatch):
    import jax

    from jaxtrain import hardware as catalog
    from jaxtrain import metrics
    from jaxtrain.precision import PRECISIONS

    fake = type("Device", (), {"platform": "gpu", "device_kind": device_kind})()
    monkeypatch.setattr(jax, "local_devices", lambda: [fake])
    peak, source = metrics.peak_flops_per_device("bfloat16")
    assert peak == catalog.get(entry).peak_flops(PRECISIONS["bfloat16"])
    assert source == f"datasheet {entry} bfloat16"

