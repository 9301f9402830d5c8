"""Stopping, crashing and resuming lose nothing (issue 14, part A): the stop message comes
after the commit, Ctrl-C during start-up, the workdir lock, config changes on resume,
partial metrics lines, checksummed manifests and health-aware rotation, one-line errors.
Issue 25: a restored state is checked before it is trusted (A.1), and a stop during start-up
takes effect at once (B.12)."""

import contextlib
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from helpers import run_commands
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.checkpoint import Checkpoints, LocalCheckpoints, file_checksum, tree_bits, tree_sums
from jaxtrain.commands import report
from jaxtrain.data import make_batches
from jaxtrain.errors import CheckpointError, ConfigError, DataError
from jaxtrain.train import loop
from jaxtrain.train.evaluation import Evaluator
from jaxtrain.train.guards import BadStepGuard
from jaxtrain.train.hooks import Halt, StepInfo
from jaxtrain.train.loop import run
from jaxtrain.train.restore_check import contents_problem, first_loss_problem
from jaxtrain.train.setup import build
from jaxtrain.xla_flags import with_device_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--config", "configs/tiny.py", "--config.model.d_model=64",
        "--config.model.num_layers=2", "--config.model.seq_len=64",
        "--config.train.global_batch=16", "--config.log_every_steps=1",
        "--config.eval_every_steps=1000"]


class Cli:
    """`python -m jaxtrain.main` on the tiny model, its stderr collected as it comes."""

    def __init__(self, workdir, *args):
        env = dict(os.environ, XLA_FLAGS=with_device_count(1),
                   PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxtrain.main", *TINY, *args, f"--workdir={workdir}"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in iter(self.process.stderr.readline, ""):
            self.lines.extend(line.replace("\r", "\n").splitlines())

    @property
    def err(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            assert self.process.poll() is None or self.reader.is_alive(), self.err[-3000:]
            time.sleep(0.01)
        raise TimeoutError(f"{pattern!r} never came:\n{self.err[-3000:]}")

    def finish(self, timeout: float = 300) -> int:
        code = self.process.wait(timeout)
        self.reader.join(10)
        return code


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _committed(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_the_stop_message_comes_after_the_commit_even_with_two_ctrl_c(tmp_path):
    cli = Cli(tmp_path, "--config.steps=2000", "--config.checkpoint.every_steps=0")
    cli.wait_for(r"loss=")  # training: a logged step
    cli.process.send_signal(signal.SIGINT)
    # Python runs a handler once for signals that arrive before the main thread gets to it
    # (a step can hold it for seconds on a loaded machine), so the second Ctrl-C is sent
    # once the first one has been taken.
    cli.wait_for(r"stopping at the end of this step")
    cli.process.send_signal(signal.SIGINT)  # a double Ctrl-C keeps the checkpoint
    stopped = int(cli.wait_for(r"stopped at step (\d+) on SIGINT; the checkpoint is durable")[1])
    cli.process.kill()  # kill -9 as soon as the message appears
    cli.finish()
    assert "will finish first" in cli.err
    assert "Traceback" not in cli.err
    assert _committed(tmp_path) == [stopped], "the step the message names is on disk"
    rerun = Cli(tmp_path, "--config.steps=" + str(stopped + 1),
                "--config.checkpoint.every_steps=0")
    assert rerun.finish() == 0, rerun.err[-3000:]
    assert f"resuming at step {stopped}" in rerun.err


def _kept(workdir):
    """The bytes of the workdir's checkpoints, manifests and logged rows (an empty
    metrics.jsonl holds no row)."""
    return {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and p.stat().st_size
            and (p.name == "metrics.jsonl"
                 or p.relative_to(workdir).parts[0].startswith("checkpoint"))}


def _holds_lock(workdir, process, timeout=300):
    """Until `process` holds the workdir's lock: it is past its imports and builds, and
    restores (or initialises), compiles and evaluates next."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        with contextlib.suppress(OSError):
            if f'"pid": {process.pid},' in (workdir / ".lock").read_text():
                return
        time.sleep(0.02)
    raise TimeoutError(f"pid {process.pid} never held {workdir / '.lock'}")


@pytest.mark.slow
def test_ctrl_c_during_start_up_stops_at_once_fresh_or_resuming(tmp_path):
    # Issue 14, A2: clean, with the handlers in place before jax loads (the first signal
    # comes during the imports). Issue 25, B.12: at once, not after the compile and the
    # first evaluation (51 s); no step, no evaluation row, the checkpoint untouched.
    for attempt in ("fresh", "resuming"):
        if attempt == "resuming":
            short = Cli(tmp_path, "--config.steps=2")
            assert short.finish() == 0, short.err[-2000:]
        kept = _kept(tmp_path)
        cli = Cli(tmp_path, "--config.steps=2000", "--config.checkpoint.every_steps=0")
        if attempt == "fresh":
            time.sleep(2.5)  # during the imports
        else:
            _holds_lock(tmp_path, cli.process)
            time.sleep(0.5)  # restoring or compiling
        sent = time.time()
        cli.process.send_signal(signal.SIGINT)
        assert cli.finish() == 0, cli.err[-3000:]
        took = time.time() - sent
        assert "Traceback" not in cli.err and "Fatal" not in cli.err, cli.err[-3000:]
        phase = re.search(r"stopped on SIGINT before training \(((before|while) [\w ]+)\); "
                          r"nothing new to save; the next run (starts at step 0|resumes at "
                          r"step 2|resumes from the newest intact checkpoint)$", cli.err, re.M)
        assert phase, cli.err[-3000:]
        assert took < 20, f"{took:.1f}s from the signal to the exit ({phase[1]})"
        assert _kept(tmp_path) == kept, "no step ran, nothing was evaluated or saved"
    assert _committed(tmp_path) == [2]


@pytest.mark.parametrize("phase", ["restoring", "compiling", "evaluating"])
def test_a_stop_during_a_start_up_phase_ends_the_wait_for_it(tmp_path, devices, capfd,
                                                             monkeypatch, phase):
    # Issue 25, B.12: a phase that a stop comes in (here one that never ends by itself) is
    # left running; the run stops at once, before anything is evaluated or saved.
    cfg = small_config(**{"steps": 4, "checkpoint.every_steps": 1})
    if phase != "evaluating":  # a checkpoint to resume from (evaluating: a fresh start)
        saved = Checkpoints(tmp_path / "checkpoints", keep=3)
        saved.save(2, build(cfg, devices[:1]).init_state().tree(), cfg.to_dict())
        saved.close()
    kept = _kept(tmp_path)
    release = threading.Event()

    def stalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(120)
        raise RuntimeError("abandoned")

    target = {"restoring": (loop, "restore_or_init"), "compiling": (loop, "_compile"),
              "evaluating": (Evaluator, "evaluate")}[phase]
    monkeypatch.setattr(*target, stalled)
    capfd.readouterr()
    try:
        assert run(cfg, tmp_path, devices[:1]) == []
        left = [t for t in threading.enumerate() if t.name == f"jaxtrain-{phase}"]
        assert left and left[0].is_alive(), "the run did not wait for the phase"
    finally:
        release.set()
    then = "starts at step 0" if phase == "evaluating" else "resumes " + (
        "from the newest intact checkpoint" if phase == "restoring" else "at step 2")
    assert (f"jaxtrain: stopped on SIGINT before training (while {phase}); nothing new to "
            f"save; the next run {then}") in capfd.readouterr().err
    assert _kept(tmp_path) == kept, "nothing evaluated, nothing saved, no manifest written"


def test_a_workdir_in_use_is_refused_and_a_dead_holders_lock_taken_over(tmp_path, devices,
                                                                         capfd):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from jaxtrain.workdir import WorkdirLock; "
         f"lock = WorkdirLock(__import__('pathlib').Path({str(tmp_path)!r})); lock.acquire(); "
         "print('held', flush=True); time.sleep(600)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    cfg = small_config(steps=2)
    with pytest.raises(ConfigError, match=rf"--workdir={tmp_path} is in use by pid "
                       rf"{holder.pid} on \S+ since \S+ \({tmp_path}/.lock\)"):
        run(cfg, tmp_path, devices[:1])
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    holder.kill()
    holder.wait()
    capfd.readouterr()
    assert [r["step"] for r in run(cfg, tmp_path, devices[:1])] == [1, 2]
    assert f"taking over the lock of pid {holder.pid}" in capfd.readouterr().err
    assert (tmp_path / ".lock").read_text() == "", "released when the run ends"


@pytest.mark.slow
def test_a_config_change_on_resume_is_a_config_error_that_moves_nothing(tmp_path, devices):
    run(small_config(steps=3), tmp_path, devices[:1])
    for manifest in (tmp_path / "checkpoint_manifests").iterdir():
        manifest.unlink()  # as after a crash: no manifests to vouch for the files
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"the checkpoint at step 3 in .* does not fit this "
                       r"config \(train.precision='float16' \(was 'float32'\)\): its state "
                       r"lacks loss_scale"):
        run(small_config(steps=6, **{"train.precision": "float16"}), tmp_path, devices[:1])
    assert not (tmp_path / "checkpoints_damaged").exists()
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert before == after, "nothing moved, nothing written"
    resumed = run(small_config(steps=5), tmp_path, devices[:1])
    assert [r["step"] for r in resumed] == [4, 5]


def test_a_partial_last_metrics_line_is_dropped_and_the_run_goes_on(tmp_path, devices, capfd):
    run(small_config(**{"steps": 4, "checkpoint.every_steps": 2}), tmp_path, devices[:1])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    capfd.readouterr()
    rows = report.load_rows(tmp_path)
    assert [r["step"] for r in rows][-1] == 4
    assert "its last line is partial" in capfd.readouterr().err
    run(small_config(**{"steps": 6, "checkpoint.every_steps": 2}), tmp_path, devices[:1])
    assert "its last line is partial" in capfd.readouterr().err
    assert [r["step"] for r in _rows(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def _flip_4kb(directory, size=4096):
    """Inverts `size` bytes in the middle of the directory's largest file."""
    victim = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle:middle + size] = bytes(b ^ 0xFF for b in data[middle:middle + size])
    victim.write_bytes(bytes(data))
    return victim


def test_every_checkpoint_is_checksummed_and_same_size_corruption_falls_back(
        tmp_path, devices, capfd, monkeypatch):
    cfg = small_config(**{"steps": 6, "checkpoint.every_steps": 2})
    whole = run(cfg, tmp_path, devices[:1])
    for step in (2, 4, 6):  # the async saves too
        manifest = json.loads((tmp_path / "checkpoint_manifests" / f"{step}.json").read_text())
        assert manifest["format"] == 2 and manifest["healthy"] is True
        assert manifest["files"] and all(digest for _, digest in manifest["files"].values())
    victim = _flip_4kb(tmp_path / "checkpoints" / "6")
    # As if the run had died between orbax's commit of step 4 and its checksums: the next
    # run gives step 4 its manifest.
    (tmp_path / "checkpoint_manifests" / "4.json").unlink()
    capfd.readouterr()
    resumed = run(cfg, tmp_path, devices[:1])
    err = capfd.readouterr().err
    assert re.search(rf"checkpoint step 6 in .* is damaged: {re.escape(str(victim))} has "
                     r"changed \(checksum \w+, recorded \w+\); moved to", err), err
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[4:]]
    for step in (4, 6):  # 6: saved again after its damaged copy was set aside
        manifest = json.loads((tmp_path / "checkpoint_manifests" / f"{step}.json").read_text())
        assert manifest["files"] and all(digest for _, digest in manifest["files"].values())
    # A checkpoint whose every byte passed its checksums but that fails to restore (memory,
    # I/O) is not damage: a one-line error, and nothing is moved.
    def broken(self, step, target):
        raise MemoryError("out of memory")
    monkeypatch.setattr(LocalCheckpoints, "restore", broken)
    with pytest.raises(CheckpointError, match="passed its checksums but could not be "
                       r"restored \(MemoryError: out of memory\); nothing was moved"):
        run(small_config(**{"steps": 8, "checkpoint.every_steps": 2}), tmp_path, devices[:1])
    assert _committed(tmp_path) == [2, 4, 6]


def _flip_values(workdir, step, cfg, devices, size=8):
    """Inverts `size` bytes of the step's largest state file where they change what the
    step restores (or make it unreadable): in the middle, else further on. Where bytes land
    in orbax's files varies with the order its writes finished; some are no value's (index,
    padding), and damage there is no damage."""
    target = build(cfg, devices[:1]).abstract_state().tree()
    reader = Checkpoints(workdir / "checkpoints", keep=100, read_only=True)
    before = jax.tree.map(np.asarray, reader.restore(step, target))
    victim = max((p for p in (workdir / "checkpoints" / str(step) / "state").rglob("*")
                  if p.is_file()), key=lambda p: p.stat().st_size)
    original = victim.read_bytes()
    for fraction in (0.5, 0.4, 0.6, 0.3, 0.7):
        at = int(len(original) * fraction)
        data = bytearray(original)
        data[at:at + size] = bytes(b ^ 0xFF for b in data[at:at + size])
        victim.write_bytes(bytes(data))
        try:
            after = jax.tree.map(np.asarray, reader.restore(step, target))
        except Exception:  # noqa: BLE001 - unreadable is damage too
            break
        if any(not np.array_equal(a, b, equal_nan=True)
               for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))):
            break
    else:
        pytest.fail(f"no flip of {size} bytes in {victim} changed step {step}")
    reader.close()


def _resave(workdir, step, cfg, devices, change, keep_sums=False):
    """Step `step` saved again with change(its tree), committed without a manifest; with
    keep_sums, the sums of squares recorded are the original ones (damage after the save)."""
    saved = Checkpoints(workdir / "checkpoints", keep=100)
    tree = saved.restore(step, build(cfg, devices[:1]).abstract_state().tree())
    config = saved.restore_config(step)
    sums = workdir / "checkpoints" / str(step) / "sums" / "metadata"
    recorded = sums.read_bytes() if keep_sums else None
    shutil.rmtree(workdir / "checkpoints" / str(step))
    saved.manager.reload()
    saved.save(step, change(tree), config)
    saved.close()
    if recorded is not None:
        sums.write_bytes(recorded)
    (workdir / "checkpoint_manifests" / f"{step}.json").unlink(missing_ok=True)


def _scale_embeddings(by):
    def change(tree):
        tree["params"]["tok_embed"] = tree["params"]["tok_embed"] * by
        return tree
    return change


def _huge_query_weight(tree):
    w_q = tree["params"]["blocks"]["attn"]["w_q"]
    tree["params"]["blocks"]["attn"]["w_q"] = w_q.at[(0,) * w_q.ndim].set(-1.8576779e38)
    return tree


def test_a_damaged_checkpoint_without_a_manifest_is_set_aside_not_vouched_for(
        tmp_path, devices, capfd):
    # Issue 25, A.1: a crash between a step's commit and its manifest, and bytes damaged
    # before they reached the disk. The run was killed at step 15, before its last save.
    cfg = small_config(**{"steps": 15, "checkpoint.every_steps": 3, "checkpoint.keep": 5})
    whole = run(cfg, tmp_path, devices[:1])
    manifests = tmp_path / "checkpoint_manifests"
    shutil.rmtree(tmp_path / "checkpoints" / "15")
    (manifests / "15.json").unlink()
    # Step 12: 8 bytes inverted, as in the issue (where they land varies: NaN, a negative
    # second moment, or finite values far from the recorded sums of squares).
    (manifests / "12.json").unlink()
    _flip_values(tmp_path, 12, cfg, devices)
    # Step 9: finite but absurd (seen from the flip): only the sums show it.
    _resave(tmp_path, 9, cfg, devices, _huge_query_weight, keep_sums=True)
    # Step 6: damaged before it was saved: only the first step's loss shows it.
    _resave(tmp_path, 6, cfg, devices, _scale_embeddings(8))
    capfd.readouterr()
    resumed = run(cfg, tmp_path, devices[:1])
    err = capfd.readouterr().err
    assert re.search(r"checkpoint step 12 in \S+ is damaged: (restored, |after the first step"
                     r"|the first step|it cannot be restored).*; moved to", err), err
    assert re.search(r"checkpoint step 9 in \S+ is damaged: restored, its contents are not "
                     r"what was saved \(the sum of squares of params/blocks/attn/w_q is inf, "
                     r"saved as [\d.]+\); moved to", err), err
    assert re.search(r"checkpoint step 6 in \S+ is damaged: the first step after restoring "
                     r"it has loss [\d.]+, but metrics.jsonl has [\d.]+ for step 7 .*; moved "
                     r"to", err), err
    # Back on step 3: the same run, bit for bit, every loss finite.
    assert [r["step"] for r in resumed] == list(range(4, 16))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[3:]]
    assert all(np.isfinite(r["loss"]) for r in resumed)
    aside = sorted((tmp_path / "checkpoints_damaged").iterdir(),
                   key=lambda p: int(p.name.split("-")[0]))
    assert [p.name.split("-")[0] for p in aside] == ["6", "9", "12"], "set aside, not deleted"
    # No manifest vouches for a damaged state: each has one for the save that replaced it,
    # which the set-aside copy does not match.
    saved = Checkpoints(tmp_path / "checkpoints", keep=100)
    for step, damaged in zip((6, 9, 12), aside):
        assert saved.verify(step) is None
        files = json.loads((manifests / f"{step}.json").read_text())["files"]
        assert any(file_checksum(damaged / name) != digest
                   for name, (_, digest) in files.items()), step
    saved.close()
    # Every checkpoint damaged: a one-line error, not a fresh start at step 0.
    for step in (6, 9, 12, 15):
        shutil.rmtree(tmp_path / "checkpoints" / str(step))
    _resave(tmp_path, 3, cfg, devices, _scale_embeddings(np.nan))
    with pytest.raises(CheckpointError, match=r"none of the checkpoints in .* \(steps 3\) is "
                       "usable"):
        run(cfg, tmp_path, devices[:1])


def test_the_first_loss_after_a_restore_is_judged_against_the_logged_one():
    assert first_loss_problem(4.25, 4.25, 20, 0) is None  # a resume repeats it
    assert first_loss_problem(4.26, 4.25, 20, 0) is None  # within 1%: another mesh, kernel
    assert "but metrics.jsonl has 4.25 for step 21" in first_loss_problem(5.53, 4.25, 20, 0)
    assert first_loss_problem(5.53, None, 20, 0) is None  # no row to compare with
    assert "has loss nan" in first_loss_problem(float("nan"), None, 20, 0)
    # Saved during a run of non-finite steps: a NaN carries on the run's trouble.
    assert first_loss_problem(float("nan"), None, 20, 2) is None


def test_the_stop_for_non_finite_steps_blames_a_restored_state_not_the_learning_rate():
    nan = {"bad_steps_in_a_row": 1}
    for restored_at, advice in [(20, "suspect that checkpoint's state, not the learning "
                                     "rate: move steps 20 and later out of checkpoints/"),
                                (None, "lower the learning rate, or look at the data around "
                                       "step 21")]:
        guard = BadStepGuard(2, restored_at)
        guard.after_step(StepInfo(21, None, nan, False))
        guard.after_step(StepInfo(22, None, {"bad_steps_in_a_row": 2}, False))
        with pytest.raises(Halt, match=re.escape(advice)):
            guard.after_step(StepInfo(23, None, nan, False))


def test_a_checkpoint_of_a_broken_run_never_pushes_the_last_good_one_out(tmp_path, devices):
    cfg = small_config(**{"steps": 10, "checkpoint.every_steps": 2, "checkpoint.keep": 1,
                          "debug.nan_from_step": 5, "debug.nan_steps": 100,
                          "train.max_consecutive_bad_steps": 100})
    run(cfg, tmp_path, devices[:1])
    # Steps 6..10 ran with NaN losses (skipped): their checkpoints are not healthy, so keep=1
    # still holds step 4, the last one saved while training was healthy.
    assert _committed(tmp_path) == [4, 6, 8, 10]
    saved = Checkpoints(tmp_path / "checkpoints", keep=1)
    assert saved.healthy == {4}
    saved.close()


@pytest.mark.slow
def test_one_line_errors_and_nothing_to_do(tmp_path, devices, capfd):
    (tmp_path / "broken.py").write_text("def get_config(:\n")
    cases = [
            (["train", "--config", "configs/missing.py"], "--config=configs/missing.py: no such file"),
            (["train", "--config", str(tmp_path / "broken.py")], "cannot be loaded: SyntaxError"),
            (["plan", "--config", "configs/missing.py", "--hardware", "A100-80GB"], "no such file"),
            (["eval", f"--workdir={tmp_path / 'none'}"], "holds no checkpoints/ directory"),
            (["generate", f"--workdir={tmp_path / 'none'}", "--prompt=x"], "holds no checkpoints/"),
            (["quantize", f"--workdir={tmp_path / 'none'}", f"--out={tmp_path / 'q'}"],
             "holds no checkpoints/"),
            # prepare returns its code (not sys.exit): the dispatcher must pass it on.
            (["prepare", str(tmp_path / "none.txt"), "--train-tokenizer=300",
              f"--out={tmp_path / 'p'}"], "none.txt: no such file")]
    for (args, message), (code, _, err) in zip(cases, run_commands([a for a, _ in cases], ROOT),
                                               strict=True):
        lines = err.strip().splitlines()
        assert code == 2, (args, err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("jaxtrain: error: "), (args, lines)
        assert message in lines[0], (args, lines)
    # steps at or below the checkpoint's step: nothing to do, nothing rewritten.
    run(small_config(steps=2), tmp_path / "run", devices[:1])
    capfd.readouterr()
    assert run(small_config(steps=2), tmp_path / "run", devices[:1]) == []
    assert "nothing to do: the checkpoint at step 2" in capfd.readouterr().err


def test_no_duplicate_step_0_row_and_no_leftover_temporary_checkpoints(tmp_path, devices):
    run(small_config(steps=1), tmp_path, devices[:1])
    for path in (tmp_path / "checkpoints").iterdir():  # as if killed before the first save
        if path.name.isdigit():
            os.rename(path, tmp_path / "checkpoints" / f"{path.name}.orbax-checkpoint-tmp-1")
    (tmp_path / "checkpoint_manifests" / "1.json").unlink()
    run(small_config(steps=2), tmp_path, devices[:1])
    steps = [r["step"] for r in _rows(tmp_path)]
    assert steps.count(0) == 1 and steps == sorted(steps)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]


def test_a_uint16_file_read_as_uint32_names_data_dtype(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(70000, dtype=np.uint16).tofile(path)
    cfg = small_config(**{"data.source": "bin", "data.path": str(path), "data.dtype": "uint32"})
    with pytest.raises(DataError, match="read as data.dtype=uint32.*set data.dtype=uint16"):
        make_batches(cfg)


def test_a_prompt_longer_than_the_model_is_blamed_not_max_new_tokens():
    from jaxtrain.inference import prompt_tokens

    cfg = small_config()  # seq_len 32
    with pytest.raises(ConfigError, match=r"the prompt is 40 tokens: it must be shorter "
                       r"than the model's model.seq_len=32"):
        prompt_tokens(cfg, None, ["1"] * 40, max_new_tokens=1)
    with pytest.raises(ConfigError, match=r"--max_new_tokens=30 is too many.*at most 22"):
        prompt_tokens(cfg, None, ["1"] * 10, max_new_tokens=30)
    assert jax.device_count() == 8


def test_bit_sums_are_exact_on_any_mesh_and_see_what_squares_miss(devices):
    # Adam's second moments are tiny: one made tinier leaves the sum of squares within its
    # 1% tolerance, and only the exact bit sum (checkpoint.tree_bits) sees it.
    nu = jnp.full((64, 32), 1e-8, jnp.float32).at[0, 0].set(4e-8)
    tree = {"nu": nu, "count": jnp.array(12, jnp.int32), "w": jnp.arange(8, dtype=jnp.bfloat16)}
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(8, 1), ("a", "b"))
    spread = {"nu": jax.device_put(nu, NamedSharding(mesh, P("a", "b"))),
              "count": tree["count"], "w": tree["w"]}
    assert tree_bits(spread) == tree_bits(tree)  # wrapping integer sums: any order
    damaged = dict(tree, nu=nu.at[0, 0].set(1e-30))
    assert math.isclose(tree_sums(damaged)["nu"], tree_sums(tree)["nu"], rel_tol=0.01)
    assert tree_bits(damaged)["nu"] != tree_bits(tree)["nu"]
    assert tree_bits(dict(tree, count=jnp.array(13, jnp.int32)))["count"] == \
        tree_bits(tree)["count"] + 1
    saved = {"sum_of_squares": tree_sums(tree), "bit_sums": tree_bits(tree)}
    assert contents_problem(tree, saved) is None
    assert contents_problem(damaged, saved).startswith(
        "its contents are not what was saved (the bits of nu sum to 0x")
