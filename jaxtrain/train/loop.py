"""The training loop: a short driver that steps and lets its hooks do the rest.

run() builds the run (train/setup.py), locks the workdir, restores or initialises the state,
compiles the step, then for every step fetches a batch, steps, and hands the result to the
hooks (train/hooks.py), each of which decides itself whether the step is its: logging one
step late, evaluation, checkpoints, the profiler window, the non-finite-step guard, and stop
requests. A hook that ends the run raises Halt; the loop then saves that step and waits
until the save is on disk before it says so.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain.data import record
from jaxtrain.data.batches import make_batches, to_global
from jaxtrain.errors import ConfigError
from jaxtrain.metrics import MetricsWriter, flops_per_token, peak_flops_per_device
from jaxtrain.models.context_attention import computed_scores
from jaxtrain.parallel.pipeline import microbatches_for_bubble
from jaxtrain.train.checkpointing import Checkpointer, Tiers, restore_or_init
from jaxtrain.train.evaluation import Evaluator
from jaxtrain.train.faults import data_with_faults
from jaxtrain.train.goodput import Goodput
from jaxtrain.train.guards import BadStepGuard, StopOnRequest
from jaxtrain.train.hooks import Halt, StepInfo
from jaxtrain.train.preemption import StopRequest
from jaxtrain.train.profiling import ProfileWindow
from jaxtrain.train.setup import Setup, build
from jaxtrain.train.step_log import StepLogger
from jaxtrain.train.task_eval import TaskEvaluator, load_tasks
from jaxtrain.train.watchdog import Watchdog
from jaxtrain.workdir import WorkdirLock, keep_metrics_up_to, prepare_workdir, write_config


class TrainingStopped(RuntimeError):
    """The run stopped itself (too many non-finite steps); the last good state is saved."""


def run(cfg, workdir: pathlib.Path, devices: Sequence[jax.Device] | None = None,
        started: float | None = None) -> list[dict]:
    """Trains to cfg.steps, resuming from the newest good checkpoint; returns the logged rows.

    Returns early, with a checkpoint, after SIGTERM/SIGINT; raises TrainingStopped after
    train.max_consecutive_bad_steps non-finite steps in a row (also with a checkpoint).
    started: when the process started (time.time()), for goodput's start-up time."""
    started = time.time() if started is None else started
    setup = build(cfg, devices)  # validates the config before anything else happens
    batches = make_batches(cfg)  # and the data
    tasks = load_tasks(cfg)  # and the downstream tasks (eval.tasks)
    data = record.run_data(cfg)  # and the data's tokenizer (its package, its vocabulary)
    prepare_workdir(workdir)
    main_process = jax.process_index() == 0
    say = _say if main_process else _quiet
    with StopRequest() as stop, _locked(workdir, main_process, say):
        tiers = Tiers(cfg, workdir, say, on_commit=stop.durable)
        writer = None
        try:
            # Before restoring: a resume on changed data is refused without reading the state.
            record.check_and_store(workdir, *data,
                                   any(tier.steps() for tier in tiers.all),
                                   cfg.data.allow_changed, write=main_process)
            start, state, restored, restoring = restore_or_init(tiers, setup, workdir)
            stop.durable(start)
            if start >= cfg.steps:
                say(f"jaxtrain: nothing to do: the checkpoint at step {start} in {workdir} is "
                    f"at or past steps={cfg.steps}; raise --config.steps to train further")
                return []
            if main_process:
                keep_metrics_up_to(workdir / "metrics.jsonl", start, say)
                write_config(workdir, cfg)
            goodput = Goodput(workdir, started, start, enabled=main_process)
            goodput.lose("checkpoint", restoring)
            writer = MetricsWriter(workdir, cfg.steps, start, enabled=main_process, cfg=cfg)
            return _train(setup, batches, tasks, state, start, restored, tiers, writer,
                          goodput, stop)
        finally:
            tiers.close()
            if writer is not None:
                writer.close()


def _train(setup: Setup, batches, tasks, state, start: int, restored: bool, tiers: Tiers,
           writer: MetricsWriter, goodput: Goodput, stop: StopRequest) -> list[dict]:
    """Compiles, evaluates at step 0, and steps to cfg.steps through the hooks."""
    cfg, workdir = setup.cfg, tiers.durable.directory.parent
    peak = peak_flops_per_device(cfg.train.precision)
    with Watchdog(cfg.train.step_timeout_s, writer.print) as watchdog:
        logger = StepLogger(writer, cfg.log_every_steps,
                            cfg.train.global_batch * cfg.model.seq_len,
                            flops_per_token(setup.spec), peak[0] * setup.mesh.devices.size,
                            cfg.train.mfu_floor, goodput, watchdog.beat)
        val_batches = [to_global(b, setup.tokens_sharding) for b in batches.val_batches()]
        with jax.set_mesh(setup.mesh):
            train_step = _compile(setup, state, val_batches[0], writer, peak,
                                  f"resuming at step {start}" if restored
                                  else "starting at step 0")
            evaluator = Evaluator(setup.eval_step(), val_batches, cfg.eval_every_steps, logger)
            if start == 0:
                with logger.outside_steps("eval"):
                    writer.write(0, {"val_loss": evaluator.evaluate(state.params)})
            if stop.requested():
                writer.print(f"jaxtrain: stopped on {stop.signal_name} before the first step; "
                             f"nothing new to save; the next run resumes at step {start}")
                return []
            checkpointer = Checkpointer(tiers, cfg, logger, start, stop)
            hooks = [ProfileWindow(workdir, cfg.profile.start_step, cfg.profile.num_steps,
                                   writer.enabled, say=writer.print),
                     logger, BadStepGuard(cfg.train.max_consecutive_bad_steps), evaluator,
                     TaskEvaluator(tasks, setup, workdir, logger), checkpointer,
                     StopOnRequest(stop)]
            goodput.training_started()
            data = data_with_faults(batches.train_iter(start), cfg.debug, start)
            _steps(setup, state, train_step, data, start, hooks, logger, checkpointer,
                   watchdog)
    goodput.finished()  # reached its steps, or stopped on request, its checkpoint durable
    return logger.rows


def _steps(setup: Setup, state, train_step, data, start: int, hooks, logger: StepLogger,
           checkpointer: Checkpointer, watchdog: Watchdog) -> None:
    """Steps from `start` to cfg.steps; on Halt, saves the step (durably), then stops."""
    steps = setup.cfg.steps
    logger.start(start)
    info = StepInfo(start, state, {}, last=start == steps)
    try:
        for step in range(start, steps):
            for hook in hooks:
                hook.before_step(step)
            tokens = logger.data.timed(lambda: to_global(next(data), setup.tokens_sharding))
            state, metrics = train_step(state, tokens)
            info = StepInfo(step + 1, state, metrics, last=step + 1 == steps)
            for hook in hooks:
                hook.after_step(info)
            watchdog.beat(step + 1)
    except Halt as halt:
        checkpointer.save_and_wait(info.step, info.state)
        if halt.error:
            raise TrainingStopped(str(halt)) from None
        logger.writer.print(f"jaxtrain: {halt}")
    logger.flush()
    checkpointer.finish()


@contextlib.contextmanager
def _locked(workdir: pathlib.Path, main_process: bool, say):
    """The workdir's lock, taken by process 0 for the whole job; every process learns
    whether it got it, so that a refused job stops everywhere with one message."""
    lock = WorkdirLock(workdir, say)
    problem = None
    if main_process:
        try:
            lock.acquire()
        except ConfigError as e:
            problem = e
    if jax.process_count() > 1:
        held = multihost_utils.broadcast_one_to_all(np.int32(problem is None))
        if not held and problem is None:
            problem = ConfigError(f"--workdir={workdir}: process 0 could not lock it")
    if problem is not None:
        raise problem
    try:
        yield lock
    finally:
        lock.release()


def _attention_text(spec) -> str:
    """The attention the run uses; under context parallelism with its per-device causal
    work, busiest over mean (1.00: balanced)."""
    if spec.context is None:
        return f"{spec.attention} attention"
    work = computed_scores(spec.context, spec.seq_len, spec.sliding_window or None)
    return (f"context-parallel attention ({spec.context.describe()}, causal work "
            f"max/mean {work.max() / work.mean():.2f})")


def _compile(setup: Setup, state, example_batch, writer, peak: tuple[float, str],
             starting: str):
    """The compiled train step, announced with the run's layout (and a bubble warning)."""
    cfg, spec = setup.cfg, setup.spec
    began = time.perf_counter()
    train_step = setup.train_step().lower(state, example_batch).compile()
    writer.print(
        f"jaxtrain: {cfg.model.family} {cfg.model.num_layers}x{cfg.model.d_model}, "
        f"{_attention_text(spec)}, mesh {dict(setup.mesh.shape)} on "
        f"{setup.mesh.devices.size} {jax.devices()[0].platform} devices, compiled in "
        f"{time.perf_counter() - began:.1f}s, peak {peak[0] / 1e12:.3g} TFLOP/s per device "
        f"({peak[1]}), {starting}")
    pipe = spec.pipeline
    if pipe is not None and pipe.bubble > 0.1:
        writer.print(
            f"jaxtrain: warning: the pipeline bubble is {pipe.bubble:.1%} of each step "
            f"({pipe.stages} stages, {pipe.microbatches} micro-batches, {pipe.repeats} "
            f"repeats); pipeline.microbatches="
            f"{microbatches_for_bubble(pipe.stages, pipe.repeats)} or more brings it "
            "under 10%")
    return train_step


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    del message
