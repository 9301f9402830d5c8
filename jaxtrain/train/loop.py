"""The training loop: a short driver that steps and lets its hooks do the rest.

run() builds the run (train/setup.py), locks the workdir, restores or initialises the state,
compiles the step, then for every step fetches a batch, steps, and hands the result to the
hooks (train/hooks.py), each of which decides itself whether the step is its: the check of
the first step from a restored state, logging one step late, evaluation, checkpoints, the
profiler window, the non-finite-step guard, and stop requests. A hook that ends the run
raises Halt; the loop then saves that step and waits until the save is on disk before it
says so. A restored state that fails its checks (train/restore_check.py) is set aside like
a damaged checkpoint, and the run starts again from the previous one.

A stop request before the first step ends the start-up at once (train/preemption.py): the
loop checks for one between its phases and waits for the long ones (restoring, compiling,
the first evaluation) in a way a stop interrupts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain.data import record
from jaxtrain.data.batches import make_batches, to_global
from jaxtrain.errors import ConfigError, WorkdirBusy
from jaxtrain.metrics import (
    MetricsWriter,
    flops_per_token,
    given_peak_tflops,
    peak_flops_per_device,
)
from jaxtrain.metrics_log import keep_metrics_up_to, read_metrics
from jaxtrain.models.attention import computed_scores
from jaxtrain.outbox import Outbox
from jaxtrain.parallel.pipeline import microbatches_for_bubble
from jaxtrain.train import frozen
from jaxtrain.train.checkpointing import Checkpointer, Restored, Tiers, restore_or_init
from jaxtrain.train.evaluation import Evaluator
from jaxtrain.train.faults import data_with_faults
from jaxtrain.train.goodput import Goodput
from jaxtrain.train.guards import BadStepGuard, StopOnRequest
from jaxtrain.train.hooks import Halt, LeaseGuard, StepInfo
from jaxtrain.train.preemption import StartupStopped, StopRequest
from jaxtrain.train.profiling import ProfileWindow
from jaxtrain.train.restore_check import FirstStepCheck, RestoreRejected, expected_first_loss
from jaxtrain.train.rollouts import Rollouter, RolloutFeed
from jaxtrain.train.setup import Setup, build
from jaxtrain.train.step_log import StepLogger
from jaxtrain.train.task_eval import TaskEvaluator, load_tasks
from jaxtrain.train.watchdog import Watchdog
from jaxtrain.workdir import CONFIG_FILE, config_text, prepare_workdir, workdir_lock

T = TypeVar("T")


class TrainingStopped(RuntimeError):
    """The run stopped itself (too many non-finite steps); the last good state is saved."""


@dataclasses.dataclass
class _Run:
    """What the sessions of one run share: a session restores, checks and trains, and a
    restored state that fails its checks (train/restore_check.py) ends it for another one
    from the previous checkpoint, with the same built pieces and the step compiled once."""

    setup: Setup
    batches: object
    tasks: list
    tiers: Tiers
    stop: StopRequest
    started: float
    say: Callable[[str], None]
    logged: dict[int, float]  # loss by step in metrics.jsonl as this run found it
    compiled: dict = dataclasses.field(default_factory=dict)  # "train", "eval" steps
    lock: object = None  # the workdir's lock (a lease on object storage: LeaseGuard)

    @property
    def workdir(self) -> pathlib.Path:
        return self.tiers.durable.directory.parent


def run(cfg, workdir: pathlib.Path, devices: Sequence[jax.Device] | None = None,
        started: float | None = None) -> list[dict]:
    """Trains to cfg.steps, resuming from the newest good checkpoint; returns the logged rows.

    Returns early, with a checkpoint, after SIGTERM/SIGINT (before the first step: at once,
    with nothing to save); raises TrainingStopped after train.max_consecutive_bad_steps
    non-finite steps in a row (also with a checkpoint).
    started: when the process started (time.time()), for goodput's start-up time."""
    started = time.time() if started is None else started
    setup = build(cfg, devices)  # validates the config before anything else happens
    # and the data: batches of a dataset, or the prompts an objective samples from
    batches = Rollouter(cfg) if setup.objective.rollouts else make_batches(cfg)
    tasks = load_tasks(cfg)  # and the downstream tasks (eval.tasks)
    data = record.run_data(cfg)  # and the data's tokenizer (its package, its vocabulary)
    frozen.check_sources(setup)  # and LoRA's base (or DPO's reference): there, of this shape
    given_peak_tflops()  # and $JAXTRAIN_PEAK_TFLOPS
    prepare_workdir(workdir)
    main_process = jax.process_index() == 0
    say = _say if main_process else _quiet
    with StopRequest() as stop, _locked(workdir, main_process, say) as lock:
        tiers = Tiers(cfg, workdir, say, on_commit=stop.durable)
        had_checkpoints = any(tier.steps() for tier in tiers.all)
        try:
            # Before restoring: a resume on changed data is refused without reading the state.
            record.check_and_store(workdir, *data, had_checkpoints,
                                   cfg.data.allow_changed, write=main_process)
            r = _Run(setup, batches, tasks, tiers, stop, started, say,
                     _logged_losses(workdir) if main_process else {}, lock=lock)
            while True:
                try:
                    return _session(r)
                except RestoreRejected as rejected:
                    rejected.set_aside()  # and the next session falls back
        except StartupStopped as stopped:
            say(_stopped_before_training(stop, stopped.phase, had_checkpoints))
            return []
        finally:
            if stop.abandoned != "restoring":  # else the abandoned restore still uses them
                tiers.close()


def _session(r: _Run) -> list[dict]:
    """Restores the newest intact checkpoint (or initialises), checks it, and trains from
    it; RestoreRejected if its state fails the checks."""
    cfg, workdir, main_process = r.setup.cfg, r.workdir, jax.process_index() == 0
    start, state, restored, restoring = r.stop.during(
        "restoring", lambda: restore_or_init(r.tiers, r.setup, workdir))
    r.stop.durable(start)
    if start >= cfg.steps:
        r.say(f"jaxtrain: nothing to do: the checkpoint at step {start} in {workdir} is "
              f"at or past steps={cfg.steps}; raise --config.steps to train further")
        return []
    # What the run writes to its workdir while it trains goes through the outbox's thread:
    # a store that stops answering holds neither the training thread nor a row (outbox.py).
    outbox = Outbox(workdir, r.say)
    if main_process:
        keep_metrics_up_to(workdir, start, r.say)
        outbox.put(workdir / CONFIG_FILE, config_text(cfg))
    goodput = Goodput(workdir, r.started, start, enabled=main_process, outbox=outbox)
    goodput.lose("checkpoint", restoring)
    r.stop.check("before compiling")
    writer = MetricsWriter(workdir, cfg.steps, start, enabled=main_process, cfg=cfg,
                           outbox=outbox)
    try:
        return _train(r, state, start, restored, writer, goodput)
    finally:
        writer.close()
        outbox.close()  # waits for the store (saying so), up to $JAXTRAIN_STORAGE_FINAL_S


def _train(r: _Run, state, start: int, restored: Restored | None, writer: MetricsWriter,
           goodput: Goodput) -> list[dict]:
    """Compiles, evaluates at step 0, and steps to cfg.steps through the hooks."""
    setup, stop = r.setup, r.stop
    cfg, workdir = setup.cfg, r.workdir
    stop.check("before compiling")  # the writer took seconds; the peak may take more
    peak = peak_flops_per_device(cfg.train.precision)
    with Watchdog(cfg.train.step_timeout_s, writer.print) as watchdog:
        logger = StepLogger(writer, cfg.log_every_steps,
                            cfg.train.global_batch * cfg.model.seq_len,
                            flops_per_token(setup.spec, setup.reference_forwards),
                            peak[0] * setup.mesh.devices.size,
                            cfg.train.mfu_floor, goodput, watchdog.beat, peak[1],
                            setup.mesh.devices.size)
        val_batches = [to_global(b, setup.tokens_sharding) for b in r.batches.val_batches()]
        example = r.batches.example(setup) if setup.objective.rollouts else val_batches[0]
        if setup.objective.rollouts:  # generating is the step's work, not a slow pipeline
            logger.warned.add("data")
        with jax.set_mesh(setup.mesh):
            train_step = _compiled(r, state, example, writer, peak,
                                   f"resuming at step {start}" if restored is not None
                                   else "starting at step 0")
            evaluator = Evaluator(r.compiled["eval"], val_batches, cfg.eval_every_steps, logger,
                                  setup.uses_reference)
            if start == 0 and val_batches:
                with logger.outside_steps("eval"):
                    value = stop.during("evaluating", _meshed(
                        setup.mesh, lambda: evaluator.evaluate(state)))
                writer.write(0, {"val_loss": value})
            stop.check("before the first step")
            checkpointer = Checkpointer(r.tiers, cfg, logger, start, stop)
            hooks = [LeaseGuard(r.lock), *_first_step_check(r, state, restored),
                     ProfileWindow(workdir, cfg.profile.start_step, cfg.profile.num_steps,
                                   writer.enabled, say=writer.print),
                     logger, BadStepGuard(cfg.train.max_consecutive_bad_steps,
                                          None if restored is None else start),
                     *([evaluator] if val_batches else []),
                     TaskEvaluator(r.tasks, setup, workdir, logger), checkpointer,
                     StopOnRequest(stop)]
            goodput.training_started()
            stop.training_started()
            _steps(setup, state, train_step, _feed(r, start), start, hooks, logger,
                   checkpointer, watchdog)
    goodput.finished()  # reached its steps, or stopped on request, its checkpoint durable
    return logger.rows


def _first_step_check(r: _Run, state, restored: Restored | None) -> list[FirstStepCheck]:
    """The check of the first step from a restored state: first among the hooks."""
    if restored is None:
        return []
    expected = expected_first_loss(r.logged, restored.step, r.setup.cfg, restored.saved)
    return [FirstStepCheck(restored, state, r.setup.shardings, expected)]


def _logged_losses(workdir: pathlib.Path) -> dict[int, float]:
    """{step: loss} of metrics.jsonl, read before a resume drops the rows past its step."""
    rows = read_metrics(workdir, say=_quiet)  # keep_metrics_up_to says it
    return {int(row["step"]): float(row["loss"]) for row in rows
            if "step" in row and isinstance(row.get("loss"), (int, float))}


def _stopped_before_training(stop: StopRequest, phase: str, had_checkpoints: bool) -> str:
    if stop.resume_at:  # restored (0: a fresh state, or a converted checkpoint)
        then = f"resumes at step {stop.resume_at}"
    else:
        then = "resumes from the newest intact checkpoint" if had_checkpoints \
            else "starts at step 0"
    return (f"jaxtrain: stopped on {stop.signal_name} before training ({phase}); nothing "
            f"new to save; the next run {then}")


def _meshed(mesh, work: Callable[[], T]) -> Callable[[], T]:
    """work, under the mesh on whichever thread runs it (jax.set_mesh is per thread)."""
    def meshed() -> T:
        with jax.set_mesh(mesh):
            return work()
    return meshed


def _feed(r: _Run, start: int) -> Callable:
    """fetch(step, state) -> (the step's global batch, host metrics): the dataset's next
    batch, or rollouts sampled with the state (an objective's, train/rollouts.py)."""
    setup = r.setup
    if setup.objective.rollouts:
        return RolloutFeed(r.batches, setup)
    data = data_with_faults(r.batches.train_iter(start), setup.cfg.debug, start)
    return lambda step, state: (to_global(next(data), setup.tokens_sharding), {})


def _steps(setup: Setup, state, train_step, fetch, start: int, hooks, logger: StepLogger,
           checkpointer: Checkpointer, watchdog: Watchdog) -> None:
    """Steps from `start` to cfg.steps; on Halt, saves the step (durably), then stops."""
    steps = setup.cfg.steps
    logger.start(start)
    info = StepInfo(start, state, {}, last=start == steps)
    try:
        for step in range(start, steps):
            for hook in hooks:
                hook.before_step(step)
            tokens, extra = logger.data.timed(lambda: fetch(step, state))  # noqa: B023
            state, metrics = train_step(state, tokens)
            info = StepInfo(step + 1, state, {**metrics, **extra}, last=step + 1 == steps)
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
    lock = workdir_lock(workdir, say)
    problem = None
    if main_process:
        try:
            lock.acquire()
        except ConfigError as e:
            problem = e
    if jax.process_count() > 1:
        held = multihost_utils.broadcast_one_to_all(np.int32(problem is None))
        if not held and problem is None:
            # Every process exits IN_USE with process 0, so a launcher retries them all.
            problem = WorkdirBusy(f"--workdir={workdir}: process 0 could not lock it")
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


def _compiled(r: _Run, state, example_batch, writer, peak: tuple[float, str],
              starting: str):
    """The compiled train step (compiled once per run: a fallback session reuses it), and
    the eval step beside it in r.compiled."""
    r.compiled.setdefault("eval", r.setup.eval_step())
    if "train" in r.compiled:
        writer.print(f"jaxtrain: {starting}")
    else:
        r.compiled["train"] = r.stop.during("compiling", _meshed(
            r.setup.mesh, lambda: _compile(r.setup, state, example_batch, writer, peak,
                                           starting)))
    return r.compiled["train"]


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
