"""Stopping, crashing and resuming lose nothing (issue 14, part A): the stop message comes
after the commit, Ctrl-C during start-up, the workdir lock, config changes on resume,
partial metrics lines, checksummed manifests and health-aware rotation, one-line errors."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import small_config

from jaxtrain.checkpoint import Checkpoints
from jaxtrain.commands import report
from jaxtrain.data import make_batches
from jaxtrain.errors import CheckpointError, ConfigError, DataError
from jaxtrain.train.loop import run
from jaxtrain.xla_flags import with_device_count

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


@pytest.mark.slow
def test_ctrl_c_during_start_up_stops_cleanly_fresh_or_resuming(tmp_path):
    for attempt, steps in enumerate((2000, 2000)):
        cli = Cli(tmp_path, f"--config.steps={steps}", "--config.checkpoint.every_steps=0")
        time.sleep(2.5)  # while it starts up: imports, restore, compile (issue 14, A2)
        cli.process.send_signal(signal.SIGINT)
        assert cli.finish() == 0, cli.err[-3000:]
        assert "Traceback" not in cli.err and "Fatal" not in cli.err, cli.err[-3000:]
        assert re.search(r"stopped (at step \d+ )?on SIGINT", cli.err), cli.err[-3000:]
        if attempt == 0 and not _committed(tmp_path):  # stopped before any step: make one
            assert "before the first step" in cli.err
            short = Cli(tmp_path, "--config.steps=2")
            assert short.finish() == 0, short.err[-2000:]
    assert max(r["step"] for r in _rows(tmp_path)) < 2000, "the resumed run stopped too"


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


def _flip_4kb(directory):
    victim = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
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
    monkeypatch.setattr(Checkpoints, "restore", broken)
    with pytest.raises(CheckpointError, match="passed its checksums but could not be "
                       r"restored \(MemoryError: out of memory\); nothing was moved"):
        run(small_config(**{"steps": 8, "checkpoint.every_steps": 2}), tmp_path, devices[:1])
    assert _committed(tmp_path) == [2, 4, 6]


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
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "jaxtrain", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    (tmp_path / "broken.py").write_text("def get_config(:\n")
    for args, message in [
            (["train", "--config", "configs/missing.py"], "--config=configs/missing.py: no such file"),
            (["train", "--config", str(tmp_path / "broken.py")], "cannot be loaded: SyntaxError"),
            (["plan", "--config", "configs/missing.py", "--hardware", "A100-80GB"], "no such file"),
            (["eval", f"--workdir={tmp_path / 'none'}"], "holds no checkpoints/ directory"),
            (["generate", f"--workdir={tmp_path / 'none'}", "--prompt=x"], "holds no checkpoints/"),
            (["quantize", f"--workdir={tmp_path / 'none'}", f"--out={tmp_path / 'q'}"],
             "holds no checkpoints/"),
            # prepare returns its code (not sys.exit): the dispatcher must pass it on.
            (["prepare", str(tmp_path / "none.txt"), "--train-tokenizer=300",
              f"--out={tmp_path / 'p'}"], "none.txt: no such file")]:
        result = cli(*args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (args, result.stderr[-2000:])
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
