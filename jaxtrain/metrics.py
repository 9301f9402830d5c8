"""Model FLOPs, peak FLOP/s, and the writer of logged metrics: the progress bar and the
run's metric sinks (sinks.py)."""

from __future__ import annotations

import functools
import math
import pathlib
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import tqdm

from jaxtrain import hardware, retry, sinks

# models.flops re-exported: the training loop and the scripts read model FLOPs from here.
from jaxtrain.models.flops import attention_flops_per_token, flops_per_token, matmul_params  # noqa: F401
from jaxtrain.precision import PRECISIONS


def best_time(time_once: Callable[[], float], repeats: int = 5, rounds: int = 4,
              spread: float = 0.1) -> float:
    """The shortest of `repeats` timings, in rounds until one is steady: its median within
    `spread` of the best seen so far (at most `rounds`). Contention slows some timings of
    a round, or all of them for a while, and a peak taken from them reads low, which makes
    MFU read high: the rounds retry it, and the best of all of them is kept."""
    best = math.inf
    for _ in range(rounds):
        times = sorted(time_once() for _ in range(repeats))
        best = min(best, times[0])
        if times[len(times) // 2] <= best * (1 + spread):
            break
    return best


def measure_matmul_peak(dtype=jnp.float32, n: int = 2048, repeats: int = 5,
                        device: jax.Device | None = None) -> float:
    """FLOP/s of a jitted n×n matmul on one device: best_time of its timings (after
    warm-up)."""
    device = device or jax.local_devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()

    def time_once() -> float:
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        return time.perf_counter() - t0

    return 2.0 * n ** 3 / best_time(time_once, repeats)


PEAK_ENV = "JAXTRAIN_PEAK_TFLOPS"


def given_peak_tflops() -> float:
    """$JAXTRAIN_PEAK_TFLOPS, or 0 where unset; ConfigError (one line) unless a number > 0."""
    return retry.env_number(PEAK_ENV, 0.0, unit="TFLOP/s")


def peak_flops_per_device(precision: str) -> tuple[float, str]:
    """(FLOP/s, where it came from): $JAXTRAIN_PEAK_TFLOPS where set (a device the catalog
    lacks, or a host whose peak is already known: the CPU measurement takes ~1 s of every
    start), else a datasheet figure for known accelerators, else measured."""
    given = given_peak_tflops()
    if given:
        return given * 1e12, f"${PEAK_ENV}"
    device = jax.local_devices()[0]
    # 16-bit and fp8 runs are judged against the bf16 peak (fp8 MFU is often quoted that way).
    peak = PRECISIONS[PRECISIONS[precision].peak]
    if device.platform != "cpu":
        name = hardware.for_device_kind(device.device_kind)
        if name is not None:
            try:
                return (hardware.get(name).peak_flops(peak),
                        f"datasheet {name} {peak.name}")
            except hardware.HardwareError:  # no datasheet figure for this precision
                pass
    dtype = jnp.float32 if device.platform == "cpu" else peak.compute_dtype
    n = 2048 if device.platform == "cpu" else 8192
    name = jnp.dtype(dtype).name
    return _measured_peak(name, n), f"measured {n}x{n} {name} matmul"


@functools.cache  # once per process: a later run in it (eval, tests) does not wait again
def _measured_peak(dtype_name: str, n: int) -> float:
    return measure_matmul_peak(jnp.dtype(dtype_name), n)


class MetricsWriter:
    """Writes logged metrics to the run's sinks (sinks.py: metrics.jsonl, TensorBoard, W&B,
    as metrics.sinks says) and the progress bar, on process 0."""

    def __init__(self, workdir: pathlib.Path, total_steps: int, start_step: int,
                 enabled: bool = True, cfg=None, outbox=None):
        """cfg: the run's config, for metrics.sinks (None: metrics.jsonl and TensorBoard);
        outbox: the run's writer thread for a remote workdir (outbox.py; None: the sinks'
        own)."""
        self.enabled = enabled
        self.bar = None
        self.sinks: list = []
        if not enabled:
            return
        names = sinks.sink_names(cfg) if cfg is not None else ("jsonl", "tensorboard")
        self.sinks = sinks.open_sinks(workdir, cfg, start_step, names, outbox)
        self.bar = tqdm.tqdm(total=total_steps, initial=start_step, unit="step",
                             dynamic_ncols=True, mininterval=1.0)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {k: v for k, v in metrics.items() if k != "step"}
        for sink in self.sinks:
            sink.write(int(step), row)
        shown = {k: f"{row[k]:.4g}" for k in ("loss", "val_loss", "tokens_per_s", "mfu")
                 if k in row}
        self.bar.set_postfix(shown, refresh=False)

    def flush(self) -> None:
        """Makes the rows written so far durable, in every sink that can (Sink.flush)."""
        for sink in self.sinks:
            if hasattr(sink, "flush"):  # optional: a sink may store each row as it comes
                sink.flush()

    def sync(self, timeout: float | None = None) -> bool:
        """Waits until the rows flushed so far are stored (or their writes gave up), in
        every sink that writes in the background; False when `timeout` ran out."""
        return all(sink.sync(timeout) for sink in self.sinks if hasattr(sink, "sync"))

    def advance(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def print(self, message: str) -> None:
        if self.enabled:
            tqdm.tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        for sink in self.sinks:
            sink.close()
