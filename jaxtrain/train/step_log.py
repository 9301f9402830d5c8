"""Logged steps: metrics fetched one step late, so the device never waits for the host, and
the wall time between fetches turned into step time, tokens/s and MFU.

With packed documents each step reports the tokens it trained (`trained_tokens`: inputs that
are no padding); tokens/s and MFU count those, summed over every step of the interval (the
steps' counts stay on the device until the row is written).

Steps run ahead of the host (dispatch is asynchronous), so work between steps (an
evaluation, a checkpoint) would otherwise wait for the steps dispatched before it and charge
their device time to itself: `outside_steps` first waits for the newest step, so that its
time stays in the interval's step time (the last row of a run, whose final evaluation and
save used to take in all the steps since the previous row, read 0.063 s for 1.5 s steps).

MFU is model FLOP/s over the peak (metrics.py peak_flops_per_device: $JAXTRAIN_PEAK_TFLOPS, a
datasheet figure, or a matmul measured at start-up). An MFU over 1 says the peak is wrong, not
the model: it is left out of the row, the row says `mfu_peak_suspect: 1`, and a warning names
the peak once. The first row of each session records the peak (`peak_flops_per_device`,
`peak_source`), which `jaxtrain report` shows."""

from __future__ import annotations

import contextlib
import time

import jax
import numpy as np

from jaxtrain.metrics import MetricsWriter
from jaxtrain.train.goodput import Goodput
from jaxtrain.train.hooks import Hook, StepInfo, due
from jaxtrain.train.profiling import DATA_WAIT_WARNING, DataClock


class StepLogger(Hook):
    """Logs every `every` steps and the last; `rows` holds what was written."""

    def __init__(self, writer: MetricsWriter, every: int, tokens_per_step: int,
                 flops_per_token: float, peak_flops: float, mfu_floor: float = 0.0,
                 goodput: Goodput | None = None, beat=None, peak_source: str = "",
                 devices: int = 1):
        """peak_flops: of all `devices` together; peak_source: where the per-device peak
        came from (recorded with it in the session's first row)."""
        self.writer, self.every, self.tokens_per_step = writer, every, tokens_per_step
        self.goodput, self.beat = goodput, beat or (lambda: None)
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.mfu_floor, self.peak_source = mfu_floor, peak_source
        self.devices = devices
        self.data = DataClock()
        self.latest = None  # the newest step's metrics: ready when that step is done
        # (step, device metrics, extra host values, trained-token counts) not yet written
        self.pending = None
        self.counts: list = []  # this interval's per-step trained tokens, on the device
        self.rows: list[dict] = []
        self.warned: set[str] = set()
        self.excluded = 0.0
        self.clock_time, self.clock_step = time.perf_counter(), 0

    def start(self, step: int) -> None:
        """Time from here: the first logged interval starts at `step`."""
        self.clock_time, self.clock_step, self.excluded = time.perf_counter(), step, 0.0
        self.data.take()

    @contextlib.contextmanager
    def outside_steps(self, cause: str):
        """Work between steps (cause: 'eval', 'checkpoint') that the step time leaves out
        and goodput charges to its cause."""
        if self.latest is not None:  # the steps dispatched so far are step time
            jax.block_until_ready(self.latest)
        start = time.perf_counter()
        self.beat()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.excluded += elapsed
            if self.goodput is not None:
                self.goodput.lose(cause, elapsed)
            self.beat()

    def after_step(self, info: StepInfo) -> None:
        self.flush()
        self.latest = info.metrics
        if "trained_tokens" in info.metrics:
            self.counts.append(info.metrics["trained_tokens"])
        if due(info.step, self.every, info.last):
            self.pending = (info.step, info.metrics, {}, self.counts or None)
            self.counts = []
        self.writer.advance(1)

    def attach(self, step: int, values: dict) -> None:
        """Adds host values (val_loss) to step's row: the pending one, else a row of its own."""
        if self.pending is not None and self.pending[0] == step:
            self.pending[2].update(values)
        else:
            self.writer.write(step, values)

    def flush(self) -> None:
        if self.pending is None:
            return
        step, metrics, extra, counts = self.pending
        self.pending = None
        row = {"step": step, **{k: _number(v) for k, v in jax.device_get(metrics).items()}}
        now = time.perf_counter()
        steps = max(step - self.clock_step, 1)
        step_time = (now - self.clock_time - self.excluded) / steps
        self.clock_time, self.clock_step, self.excluded = now, step, 0.0
        row["step_time_s"] = step_time
        row["data_wait_s"] = min(self.data.take() / steps, step_time)
        row["device_time_s"] = step_time - row["data_wait_s"]
        if counts is None:
            row["tokens_per_s"] = self.tokens_per_step / step_time
        else:  # packed documents: the tokens trained, padding left out
            row["tokens_per_s"] = float(np.sum(jax.device_get(counts))) / (step_time * steps)
        row.update(self._mfu(row))
        row.update(extra)
        if self.goodput is not None:
            self.goodput.steps(step - steps, step, row["device_time_s"] * steps,
                               row["data_wait_s"] * steps)
            row.update(self.goodput.summary())
            self.goodput.save()
        if not self.rows:
            row.update(peak_flops_per_device=self.peak_flops / self.devices,
                       peak_source=self.peak_source)
        self.writer.write(step, row)
        if "mfu_peak_suspect" in row:
            self._warn_peak(row)
        if self.rows:  # the first interval includes warm-up: judge from the second on
            self._warn_once(row)
        self.rows.append(row)

    def _mfu(self, row: dict) -> dict:
        """{"mfu": ...}, or where it comes out over 1 (the peak is too low: a matmul timed
        under contention, or slower than the model's own) {"mfu_peak_suspect": 1}."""
        mfu = self.flops_per_token * row["tokens_per_s"] / self.peak_flops
        return {"mfu": mfu} if mfu <= 1.0 else {"mfu_peak_suspect": 1}

    def _warn_peak(self, row: dict) -> None:
        if "peak" in self.warned:
            return
        self.warned.add("peak")
        mfu = self.flops_per_token * row["tokens_per_s"] / self.peak_flops
        self.writer.print(
            f"jaxtrain: warning: MFU came out at {mfu:.3g} at step {row['step']}, over 1: the "
            f"peak it divides by ({self.peak_flops / self.devices / 1e12:.3g} TFLOP/s per "
            f"device, {self.peak_source or 'given'}) is too low, e.g. measured while the "
            "machine was busy; rows over 1 leave mfu out and say mfu_peak_suspect")

    def _warn_once(self, row: dict) -> None:
        waiting = row["data_wait_s"] / row["step_time_s"]
        if waiting > DATA_WAIT_WARNING and "data" not in self.warned:
            self.warned.add("data")
            self.writer.print(f"jaxtrain: warning: waiting for data took {waiting:.1%} of "
                              f"step {row['step']}'s time (over {DATA_WAIT_WARNING:.0%}): the "
                              "input pipeline is a bottleneck; raise data.prefetch")
        if row.get("mfu", 1.0) < self.mfu_floor and "mfu" not in self.warned:
            self.warned.add("mfu")
            self.writer.print(f"jaxtrain: warning: MFU {row['mfu']:.3f} at step {row['step']} "
                              f"is under train.mfu_floor={self.mfu_floor}; profile it with "
                              "--config.profile.start_step")


def _number(value):
    value = np.asarray(value)
    return int(value) if value.dtype.kind in "iu" else float(value)
