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
    # The suite gives every run its peak (conftest.py): the row and the report say so.
    assert rows[0]["peak_flops_per_device"] == 0.2e12
    assert rows[0]["peak_source"] == "$JAXTRAIN_PEAK_TFLOPS"
    assert "MFU peak: 0.2 TFLOP/s per device ($JAXTRAIN_PEAK_TFLOPS)" in out


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

    monkeypatch.delenv(metrics.PEAK_ENV)  # the suite's own peak (conftest.py)
    fake = type("Device", (), {"platform": "gpu", "device_kind": device_kind})()
    monkeypatch.setattr(jax, "local_devices", lambda: [fake])
    peak, source = metrics.peak_flops_per_device("bfloat16")
    assert peak == catalog.get(entry).peak_flops(PRECISIONS["bfloat16"])
    assert source == f"datasheet {entry} bfloat16"


def test_on_cpu_the_peak_is_measured_unless_given_and_a_bad_one_is_one_line(
        tmp_path, devices, monkeypatch):
    from jaxtrain import metrics
    from jaxtrain.errors import ConfigError

    monkeypatch.delenv(metrics.PEAK_ENV)
    peak, source = metrics.peak_flops_per_device("float32")
    assert peak > 1e9 and source == "measured 2048x2048 float32 matmul"
    monkeypatch.setenv(metrics.PEAK_ENV, "0.25")
    assert metrics.peak_flops_per_device("bfloat16") == (0.25e12, "$JAXTRAIN_PEAK_TFLOPS")
    for bad in ("fast", "0", "-1", "nan"):
        monkeypatch.setenv(metrics.PEAK_ENV, bad)
        with pytest.raises(ConfigError) as error:
            run(small_config(steps=1), tmp_path / "run", devices[:1])
        assert str(error.value) == f"JAXTRAIN_PEAK_TFLOPS={bad}: must be a number of TFLOP/s > 0"
        assert not (tmp_path / "run").exists(), "refused before anything is written"



# --- MFU: the peak, the last row's time, MFU over 1 (issue 35 item 9) ----------------

def test_the_matmul_peak_is_the_best_of_rounds_retried_while_timings_spread():
    from jaxtrain.metrics import best_time

    def timer(times):
        it = iter(times)
        return lambda: next(it)

    # steady at once: one round of 5
    calls = [1.0, 1.02, 1.01, 1.05, 1.0]
    assert best_time(timer(calls)) == 1.0
    # contention in round 1 (a median 2x its best), steady in round 2: 2 rounds, best 1.0
    contended = [4.0, 2.0, 1.6, 3.0, 2.5]
    steady = [1.0, 1.03, 1.01, 1.02, 1.0]
    assert best_time(timer(contended + steady + [99.0] * 5)) == 1.0
    # a round whose median trails the best seen so far is retried too, at most `rounds`
    assert best_time(timer([1.0] + [3.0] * 4 + [1.5] * 5 + [1.01] * 5), rounds=3) == 1.0
    assert best_time(timer([4.0, 3.0, 2.0, 3.0, 4.0] * 2), rounds=2) == 2.0


class _FakeDevice:
    """Steps that take `step_s` of device time each, queued behind each other; the host
    dispatches at once and waits only where it reads (or blocks on) a step's metrics."""

    def __init__(self, step_s: float):
        self.now, self.step_s, self.done = 0.0, step_s, 0.0

    def dispatch(self, loss: float):
        self.done = max(self.now, self.done) + self.step_s
        return _FakeValue(self, self.done, loss)

    def perf_counter(self) -> float:
        return self.now


class _FakeValue:
    def __init__(self, device, ready_at: float, value: float):
        self.device, self.ready_at, self.value = device, ready_at, value

    def block_until_ready(self):
        self.device.now = max(self.device.now, self.ready_at)
        return self

    def __array__(self, dtype=None, copy=None):
        self.block_until_ready()
        import numpy as np
        return np.asarray(self.value, dtype=dtype)


class _ListWriter:
    def __init__(self):
        self.rows, self.printed = [], []

    def write(self, step, row):
        self.rows.append({"step": step, **row})

    def advance(self, steps):
        pass

    def print(self, message):
        self.printed.append(message)


def _logged_run(monkeypatch, steps: int, every: int, peak: float, eval_s: float = 0.5):
    """StepLogger driven as loop._steps drives it, on a fake clock: 1 s steps, and at the
    last step an evaluation (eval_s of device time after the steps) in outside_steps."""
    from jaxtrain.train import step_log
    from jaxtrain.train.hooks import StepInfo

    device = _FakeDevice(1.0)
    monkeypatch.setattr(step_log.time, "perf_counter", device.perf_counter)
    writer = _ListWriter()
    logger = step_log.StepLogger(writer, every, tokens_per_step=100, flops_per_token=10.0,
                                 peak_flops=peak, peak_source="measured fake", devices=2)
    logger.start(0)
    for step in range(steps):
        metrics = {"loss": device.dispatch(1.0 / (step + 1))}
        info = StepInfo(step + 1, None, metrics, last=step + 1 == steps)
        logger.after_step(info)
        if info.last:
            with logger.outside_steps("eval"):  # the eval's batches queue behind the steps
                device.now = max(device.now, device.done) + eval_s
    logger.flush()
    return writer


def test_the_last_row_keeps_the_steps_its_evaluation_waited_for(monkeypatch):
    """The last step's evaluation (and save) wait for the steps still running; that wait
    is step time, not evaluation time: every row, the last included, reads 1 s steps (the
    last read 0 here, 0.063 s for 1.5 s steps in a real run)."""
    writer = _logged_run(monkeypatch, steps=4, every=2, peak=1e12)
    assert [r["step"] for r in writer.rows] == [2, 4]
    assert [r["step_time_s"] for r in writer.rows] == pytest.approx([1.0, 1.0])


def test_an_mfu_over_1_is_never_written_and_the_peak_is_flagged(monkeypatch):
    """1000 model FLOP/s against a peak of 600 for both devices: MFU 1.67 is left out, the
    rows say mfu_peak_suspect, one warning names the peak; the first row records the
    per-device peak and where it came from, which the report shows."""
    writer = _logged_run(monkeypatch, steps=4, every=1, peak=600.0)
    rows = writer.rows
    assert all("mfu" not in r and r["mfu_peak_suspect"] == 1 for r in rows)
    warnings = [m for m in writer.printed if "over 1" in m]
    assert len(warnings) == 1 and "300 TFLOP/s" not in warnings[0]
    assert "measured fake" in warnings[0] and "per device" in warnings[0]
    assert rows[0]["peak_flops_per_device"] == 300.0
    assert rows[0]["peak_source"] == "measured fake"
    assert all("peak_source" not in r for r in rows[1:])
    text = report.summary(rows)
    assert "MFU n/a" in text and "(measured fake)" in text
    assert "MFU over 1 at 4 logged step(s) (first 1)" in text
    fine = _logged_run(monkeypatch, steps=2, every=1, peak=1e6).rows
    assert all(0 < r["mfu"] <= 1 and "mfu_peak_suspect" not in r for r in fine)
    assert "MFU 0.001" in report.summary(fine)
