"""The training loop: resume, step, log one step late, evaluate, checkpoint, stop cleanly."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Sequence

import jax
import numpy as np

from jaxtrain.checkpoint import Checkpoints
from jaxtrain.config import ConfigError
from jaxtrain.data.pipeline import make_batches, to_global
from jaxtrain.metrics import MetricsWriter, flops_per_token, peak_flops_per_device
from jaxtrain.parallel.pipeline import microbatches_for_bubble
from jaxtrain.train.preemption import StopRequest
from jaxtrain.train.profiling import DATA_WAIT_WARNING, DataClock, ProfileWindow
from jaxtrain.train.setup import build

# Config keys that fix the shapes and structure of the checkpointed state.
STATE_KEYS = ("model.family", "model.d_model", "model.num_layers", "model.num_heads",
              "model.num_kv_heads", "model.head_dim", "model.mlp_dim", "model.vocab_size",
              "model.seq_len")


class TrainingStopped(RuntimeError):
    """The run stopped itself (too many non-finite steps); the last good state is saved."""


class StepLogger:
    """Fetches a logged step's metrics one step late, so the device never waits for the host,
    and turns the wall time between fetches into step time, tokens/s and MFU."""

    def __init__(self, writer: MetricsWriter, tokens_per_step: int, flops_per_token: float,
                 peak_flops: float, mfu_floor: float = 0.0):
        self.writer, self.tokens_per_step = writer, tokens_per_step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.mfu_floor = mfu_floor
        self.data = DataClock()
        self.pending = None
        self.rows: list[dict] = []
        self.warned: set[str] = set()
        self.restart_clock(0)

    def restart_clock(self, step: int) -> None:
        """Time from here: called after work (eval, checkpoint) that is not a train step."""
        self.clock_time, self.clock_step = time.perf_counter(), step
        self.data.take()

    def push(self, step: int, metrics: dict) -> None:
        self.flush()
        self.pending = (step, metrics)

    def flush(self, **extra) -> None:
        if self.pending is None:
            return
        step, metrics = self.pending
        self.pending = None
        row = {"step": step, **{k: _number(v) for k, v in jax.device_get(metrics).items()}}
        now = time.perf_counter()
        steps = max(step - self.clock_step, 1)
        step_time = (now - self.clock_time) / steps
        self.clock_time, self.clock_step = now, step
        row["step_time_s"] = step_time
        row["data_wait_s"] = min(self.data.take() / steps, step_time)
        row["device_time_s"] = step_time - row["data_wait_s"]
        row["tokens_per_s"] = self.tokens_per_step / step_time
        row["mfu"] = self.flops_per_token * row["tokens_per_s"] / self.peak_flops
        row.update(extra)
        self.writer.write(step, row)
        if self.rows:  # the first interval includes warm-up: judge from the second on
            self._warn_once(row)
        self.rows.append(row)

    def _warn_once(self, row: dict) -> None:
        waiting = row["data_wait_s"] / row["step_time_s"]
        if waiting > DATA_WAIT_WARNING and "data" not in self.warned:
            self.warned.add("data")
            self.writer.print(f"jaxtrain: warning: waiting for data took {waiting:.1%} of "
                              f"step {row['step']}'s time (over {DATA_WAIT_WARNING:.0%}): the "
                              "input pipeline is a bottleneck; raise data.prefetch")
        if row["mfu"] < self.mfu_floor and "mfu" not in self.warned:
            self.warned.add("mfu")
            self.writer.print(f"jaxtrain: warning: MFU {row['mfu']:.3f} at step {row['step']} "
                              f"is under train.mfu_floor={self.mfu_floor}; profile it with "
                              "--config.profile.start_step")


def _number(value):
    value = np.asarray(value)
    return int(value) if value.dtype.kind in "iu" else float(value)


def prepare_workdir(workdir: pathlib.Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--workdir={workdir} is not writable: {e.strerror}") from None


def check_same_run(cfg, workdir: pathlib.Path):
    def check(step: int, saved: dict) -> None:
        for key in STATE_KEYS:
            section, name = key.split(".")
            before, now = saved.get(section, {}).get(name), cfg[section][name]
            if before != now:
                raise ConfigError(
                    f"{key}={now!r} does not match the checkpoint at step {step} in "
                    f"{workdir} ({key}={before!r}); use another --workdir, or the same model")
    return check


def keep_metrics_up_to(path: pathlib.Path, step: int) -> None:
    """On resume, drop logged rows past the checkpoint: the resumed run logs them again."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(row + "\n" for row in rows))


def run(cfg, workdir: pathlib.Path, devices: Sequence[jax.Device] | None = None) -> list[dict]:
    """Trains to cfg.steps, resuming from the newest good checkpoint; returns the logged rows.

    Returns early, with a checkpoint, after SIGTERM/SIGINT; raises TrainingStopped after
    train.max_consecutive_bad_steps non-finite steps in a row (also with a checkpoint)."""
    setup = build(cfg, devices)  # validates the config before anything else happens
    batches = make_batches(cfg)  # and the data
    prepare_workdir(workdir)
    main_process = jax.process_index() == 0

    def say(message: str) -> None:
        if main_process:
            print(message, file=sys.stderr, flush=True)

    checkpoints = Checkpoints(workdir / "checkpoints", cfg.checkpoint.keep,
                              cfg.checkpoint.keep_period, log=say)
    start, state = checkpoints.restore_latest(setup.abstract_state(), check_same_run(cfg, workdir))
    restored = state is not None  # step 0 too: a checkpoint made by jaxtrain.convert
    if not restored:
        state = setup.init_state()
    if main_process:
        keep_metrics_up_to(workdir / "metrics.jsonl", start)
        (workdir / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")

    eval_step = setup.eval_step()
    val_batches = [to_global(b, setup.tokens_sharding) for b in batches.val_batches()]
    peak, peak_source = peak_flops_per_device(cfg.train.precision)
    devices_used = setup.mesh.devices.size
    writer = MetricsWriter(workdir, cfg.steps, start, enabled=main_process)

    with jax.set_mesh(setup.mesh), StopRequest() as stop:
        compile_start = time.perf_counter()
        train_step = setup.train_step().lower(state, val_batches[0]).compile()
        writer.print(
            f"jaxtrain: {cfg.model.family} {cfg.model.num_layers}x{cfg.model.d_model}, "
            f"{setup.spec.attention} attention, mesh "
            f"{dict(setup.mesh.shape)} on {devices_used} {jax.devices()[0].platform} devices, "
            f"compiled in {time.perf_counter() - compile_start:.1f}s, peak "
            f"{peak / 1e12:.3g} TFLOP/s per device ({peak_source}), "
            f"{f'resuming at step {start}' if restored else 'starting at step 0'}")

        pipe = setup.spec.pipeline
        if pipe is not None and pipe.bubble > 0.1:
            writer.print(
                f"jaxtrain: warning: the pipeline bubble is {pipe.bubble:.1%} of each step "
                f"({pipe.stages} stages, {pipe.microbatches} micro-batches, {pipe.repeats} "
                f"repeats); pipeline.microbatches="
                f"{microbatches_for_bubble(pipe.stages, pipe.repeats)} or more brings it "
                "under 10%")

        def evaluate() -> float:
            return float(np.mean(jax.device_get([eval_step(state.params, b)
                                                 for b in val_batches])))

        saved = {start}

        def save(step: int) -> None:
            if step in saved:  # e.g. a stop request right after a periodic checkpoint
                return
            saved.add(step)
            logger.flush()
            checkpoints.save(step, state, cfg.to_dict())
            logger.restart_clock(step)

        if start == 0:
            writer.write(0, {"val_loss": evaluate()})
        logger = StepLogger(writer, cfg.train.global_batch * cfg.model.seq_len,
                            flops_per_token(setup.spec), peak * devices_used,
                            cfg.train.mfu_floor)
        logger.restart_clock(start)
        data = batches.train_iter(start)
        profile = ProfileWindow(workdir, cfg.profile.start_step, cfg.profile.num_steps,
                                enabled=main_process)
        previous = None  # (step, metrics) of the step before, checked once this one runs
        for step in range(start, cfg.steps):
            tokens = logger.data.timed(lambda: to_global(next(data), setup.tokens_sharding))
            profile.before_step(step)
            state, metrics = train_step(state, tokens)
            if message := profile.after_step(step, metrics):
                writer.print(message)
            done = step + 1
            logger.flush()
            if previous is not None:
                bad = int(previous[1]["bad_steps_in_a_row"])
                if bad >= cfg.train.max_consecutive_bad_steps:
                    save(done)
                    checkpoints.close()
                    writer.close()
                    raise TrainingStopped(
                        f"{bad} non-finite steps in a row up to step {previous[0]} "
                        f"(train.max_consecutive_bad_steps="
                        f"{cfg.train.max_consecutive_bad_steps}); no update was applied for "
                        f"them, and the state is checkpointed at step {done}")
            previous = (done, metrics)
            last = done == cfg.steps
            if done % cfg.log_every_steps == 0 or last:
                logger.push(done, metrics)
            if done % cfg.eval_every_steps == 0 or last:
                val_loss = evaluate()
                if logger.pending is not None:
                    logger.flush(val_loss=val_loss)
                else:
                    writer.write(done, {"val_loss": val_loss})
                logger.restart_clock(done)
            every = cfg.checkpoint.every_steps
            if (every and done % every == 0) or last:
                save(done)
            writer.advance(1)
            if not last and stop.should_stop(done):
                save(done)
                writer.print(f"jaxtrain: stopped at step {done} on {stop.signal_name or 'preemption'};"
                             " the checkpoint is durable; run the same command to resume")
                break
        logger.flush()
    checkpoints.close()
    writer.close()
    return logger.rows
