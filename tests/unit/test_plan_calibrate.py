"""The planner's calibration pipeline (jaxtrain/plan/calibrate/) as modules: each one's
command line, and the parts that need no compile or fit. The compiles themselves are CI's
(.ci/run runs memory_check) and docs/planner.md's; tests/unit/test_plan.py checks what they
stored in plan/memory_fit.json."""

import importlib
import os
import subprocess
import sys

import pytest

from jaxtrain.plan import memory, memory_fit, published
from jaxtrain.plan.calibrate import ROOT, fit_memory, fit_planner, memory_check, tpu_aot_check

MODULES = ("fit_memory", "fit_planner", "memory_check", "plan_vs_compiler", "tpu_aot_check")


@pytest.mark.parametrize("name", MODULES)
def test_each_module_answers_help_and_leaves_the_environment_alone(name, capsys):
    """Importing a module and parsing its flags sets nothing: plan_vs_compiler's fake
    devices and tpu_aot_check's libtpu environment come after (a script used to set
    XLA_FLAGS on import)."""
    before = dict(os.environ)
    module = importlib.import_module(f"jaxtrain.plan.calibrate.{name}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
    assert dict(os.environ) == before


def test_fit_memory_refuses_fewer_than_two_folds(capsys):
    with pytest.raises(SystemExit) as done:
        fit_memory.main(["--holdout", "1"])
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--holdout=1: needs K ≥ 2 folds")


def test_fit_memory_weighs_an_estimate_under_the_compiler_more():
    low, high = memory.TARGET
    assert fit_memory.badness(high) == pytest.approx(1.0)
    assert fit_memory.badness(low) == pytest.approx(fit_memory.UNDER_WEIGHT)
    assert fit_memory.badness(1.0) == 0.0


def test_fit_planner_has_a_family_for_every_published_run():
    for run in published.runs():
        assert fit_planner.family(run) in fit_planner.FAMILIES
    assert {fit_planner.DEFAULT_FAMILY, *fit_planner.NEAREST.values()} <= set(
        fit_planner.FAMILIES)


def test_memory_check_scales_published_layouts_to_a_cpu_compile():
    """Each published run's layout on ≤ MAX_DEVICES fake CPU devices and ≤ MAX_LAYERS
    layers a stage, its per-device batch kept and no GPU/TPU kernel left (what CI
    compiles)."""
    for run in published.runs():
        case = memory_check.scaled_run(run)
        cfg, sizes = memory_fit.config_of(case)
        original = memory_fit.config_of({**case, "config_file": f"published:{run['id']}",
                                         "overrides": run["config"],
                                         "devices": run["devices"]})
        assert case["devices"] <= memory_check.MAX_DEVICES, run["id"]
        assert cfg.model.num_layers <= memory_check.MAX_LAYERS * sizes["pipeline"], run["id"]
        assert cfg.model.attention not in ("cudnn", "splash", "pallas"), run["id"]
        replicas, was = sizes["data"] * sizes["fsdp"], original[1]["data"] * original[1]["fsdp"]
        assert cfg.train.global_batch * was == original[0].train.global_batch * replicas


def test_memory_check_fails_a_row_that_errs_or_leaves_the_bound(capsys):
    stored = next(c for c in memory_fit.cases("cpu"))
    rows = [{"case": "broken", "error": "did not compile"},
            {**stored, "ratio": memory.TARGET[1] * 1.1},
            {**stored, "case": stored["case"], "ratio": 1.0}]
    found = memory_check.problems(rows)
    assert len(found) == 2 and found[0] == "broken: did not compile"
    assert found[1].startswith(f"{stored['case']}: estimate / XLA")


def test_tpu_aot_check_without_libtpu_says_how_to_install_it(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(SystemExit) as done:
        tpu_aot_check.main(["--libtpu_site", str(tmp_path)])
    assert str(done.value.code) == (
        f"libtpu is not importable and not in {tmp_path}; install it with: pip install "
        f"--target {tmp_path} 'libtpu==0.0.42.*'")


def test_tpu_aot_check_reruns_itself_as_a_module_in_the_tpu_environment(tmp_path,
                                                                        monkeypatch):
    """The compile-only process is `python -m` this module, with libtpu's site and the
    repository on its path: it starts from any directory (the one below is empty)."""
    (tmp_path / "libtpu").mkdir()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else real(name, *a))
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    started = []
    monkeypatch.setattr(subprocess, "run", lambda command, env: started.append(
        (command, env)) or subprocess.CompletedProcess(command, 0))
    with pytest.raises(SystemExit) as done:
        tpu_aot_check.main(["--topology", "v5p:2x2x2", "--libtpu_site", str(tmp_path)])
    assert done.value.code == 0
    (command, env), = started
    assert command == [sys.executable, "-m", tpu_aot_check.MODULE, "--topology", "v5p:2x2x2",
                       "--libtpu_site", str(tmp_path), "--in_process"]
    assert env["JAX_PLATFORMS"] == "cpu" and env["TPU_ACCELERATOR_TYPE"] == "v5p-16"
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [ROOT, str(tmp_path)]
    monkeypatch.undo()
    help_ = subprocess.run([sys.executable, "-m", tpu_aot_check.MODULE, "--help"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "--libtpu_site" in help_.stdout, help_.stderr
