"""The training loop: resume, step, log one step late, evaluate, checkpoint."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Sequence

import jax
import numpy as np

from jaxtrain.checkpoint import Checkpoints
from jaxtrain.config import ConfigError
from jaxtrain.data.pipeline import make_batches, to_global
from jaxtrain.metrics import MetricsWriter, flops_per_token, peak_flops_per_device
from jaxtrain.train.setup import build


class StepLogger:
    """Fetches a logged step's metrics one step late, so the device never waits for the host,
    and turns the wall time between fetches into step time, tokens/s and MFU."""

    def __init__(self, writer: MetricsWriter, tokens_per_step: int, flops_per_token: float,
                 peak_flops: float):
        self.writer, self.tokens_per_step = writer, tokens_per_step
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.pending = None
        self.rows: list[dict] = []
        self.restart_clock(0)

    def restart_clock(self, step: int) -> None:
        """Time from here: called after work (eval, checkpoint) that is not a train step."""
        self.clock_time, self.clock_step = time.perf_counter(), step

    def push(self, step: int, metrics: dict) -> None:
        self.flush()
        self.pending = (step, metrics)

    def flush(self, **extra) -> None:
        if self.pending is None:
            return
        step, metrics = self.pending
        self.pending = None
        row = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
        now = time.perf_counter()
        step_time = (now - self.clock_time) / max(step - self.clock_step, 1)
        self.clock_time, self.clock_step = now, step
        row["step_time_s"] = step_time
        row["tokens_per_s"] = self.tokens_per_step / step_time
        row["mfu"] = self.flops_per_token * row["tokens_per_s"] / self.peak_flops
        row.update(extra)
        self.writer.write(step, row)
        self.rows.append(row)


def prepare_workdir(workdir: pathlib.Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--workdir={workdir} cannot be created: {e.strerror}") from None
    if not os.access(workdir, os.W_OK):
        raise ConfigError(f"--workdir={workdir} is not writable")


def run(cfg, workdir: pathlib.Path, devices: Sequence[jax.Device] | None = None) -> list[dict]:
    """Trains to cfg.steps, resuming from the newest checkpoint; returns the logged rows."""
    setup = build(cfg, devices)  # validates the config before anything else happens
    prepare_workdir(workdir)
    batches = make_batches(cfg)
    main_process = jax.process_index() == 0

    checkpoints = Checkpoints(workdir / "checkpoints", cfg.checkpoint.keep)
    start = checkpoints.latest_step() or 0
    state = checkpoints.restore(start, setup.abstract_state()) if start else setup.init_state()
    if main_process:
        (workdir / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")

    eval_step = setup.eval_step()
    val_batches = [to_global(b, setup.tokens_sharding) for b in batches.val_batches()]
    peak, peak_source = peak_flops_per_device(cfg.train.precision)
    devices_used = setup.mesh.devices.size

    writer = MetricsWriter(workdir, cfg.steps, start, enabled=main_process)
    with jax.set_mesh(setup.mesh):
        compile_start = time.perf_counter()
        train_step = setup.train_step().lower(state, val_batches[0]).compile()
        writer.print(
            f"jaxtrain: {cfg.model.family} {cfg.model.num_layers}x{cfg.model.d_model}, mesh "
            f"{dict(setup.mesh.shape)} on {devices_used} {jax.devices()[0].platform} devices, "
            f"compiled in {time.perf_counter() - compile_start:.1f}s, peak "
            f"{peak / 1e12:.3g} TFLOP/s per device ({peak_source}), "
            f"{f'resuming at step {start}' if start else 'starting at step 0'}")

        def evaluate() -> float:
            return float(np.mean(jax.device_get([eval_step(state.params, b)
                                                 for b in val_batches])))

        if start == 0:
            writer.write(0, {"val_loss": evaluate()})
        logger = StepLogger(writer, cfg.train.global_batch * cfg.model.seq_len,
                            flops_per_token(setup.spec), peak * devices_used)
        logger.restart_clock(start)
        data = batches.train_iter(start)
        for step in range(start, cfg.steps):
            state, metrics = train_step(state, to_global(next(data), setup.tokens_sharding))
            logger.flush()
            done = step + 1
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
                logger.flush()
                checkpoints.save(done, state, cfg.to_dict())
                logger.restart_clock(done)
            writer.advance(1)
        logger.flush()
    checkpoints.close()
    writer.close()
    return logger.rows
