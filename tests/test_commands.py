"""What every command does the same way: a missing optional package, an object-storage path
and --help each end in one line (or the command's own help) before anything is written."""

import importlib.machinery
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import small_config

from jaxtrain import errors
from jaxtrain.commands import prepare
from jaxtrain.config import validate
from jaxtrain.errors import JaxtrainError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def hide_packages(monkeypatch, *names):
    """find_spec answers None for `names`, as for packages that are not installed (they are
    in the test environment: the extras are part of [test])."""
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        return None if name.split(".")[0] in names else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("overrides,hidden,message", [
    ({"metrics.sinks": "jsonl,tensorboard"}, "tensorboardX",
     "metrics.sinks='jsonl,tensorboard': the tensorboard sink needs the tensorboardX package: "
     "pip install tensorboardX (a dependency of jaxtrain)"),
    ({"metrics.sinks": "jsonl,wandb"}, "wandb",
     "metrics.sinks='jsonl,wandb': the wandb sink needs the wandb package: "
     "pip install 'jaxtrain[wandb]'"),
    ({"eval.tasks": "hellaswag"}, "lm_eval",
     "eval.backend='lm_eval' needs the lm_eval package: pip install 'jaxtrain[eval]'"),
    ({"data.source": "bin", "data.path": "x.bin", "data.tokenizer": "tiktoken:gpt2"}, "tiktoken",
     "data.tokenizer=tiktoken:gpt2 (a tiktoken tokenizer) needs the tiktoken package: "
     "pip install 'jaxtrain[data]'"),
])
def test_validation_names_the_missing_package_and_its_extra(monkeypatch, overrides, hidden,
                                                           message):
    hide_packages(monkeypatch, hidden)
    with pytest.raises(JaxtrainError) as error:
        validate(small_config(**overrides), 1, "cpu")
    assert str(error.value) == message


def test_a_leftover_directory_of_an_uninstalled_package_is_missing(monkeypatch):
    # `pip uninstall` leaves a directory behind when it holds files pip did not install;
    # it then imports as an empty namespace package, without the package's code.
    leftover = importlib.machinery.ModuleSpec("wandb", None, is_package=True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: leftover if name == "wandb"
                        else real(name, package))
    assert errors.missing_package("wandb") and not errors.missing_package("json")
    with pytest.raises(JaxtrainError, match="the wandb sink needs the wandb package"):
        validate(small_config(**{"metrics.sinks": "jsonl,wandb"}), 1, "cpu")


@pytest.mark.parametrize("hidden,args,message", [
    ("datasets", ["--hf-dataset", "someone/corpus"],
     "--hf-dataset=someone/corpus needs the datasets package: pip install 'jaxtrain[data]'"),
    ("pyarrow", ["PARQUET"], "(parquet) needs the pyarrow package: pip install 'jaxtrain[data]'"),
])
def test_prepare_checks_the_packages_of_its_inputs_before_writing(monkeypatch, capsys, tmp_path,
                                                                  hidden, args, message):
    hide_packages(monkeypatch, hidden)
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    args = [str(tmp_path / "a.parquet") if a == "PARQUET" else a for a in args]
    out = tmp_path / "out"
    assert prepare.main([*args, "--out", str(out), "--tokenizer", "bytes", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxtrain: error: ") and err.endswith(message), err
    assert len(err.splitlines()) == 1
    assert not list(tmp_path.glob("out*")), "nothing written"


# A sitecustomize that makes `import NAME` fail and find_spec(NAME) answer None for the names
# in JAXTRAIN_TEST_HIDE, in a process and in what it re-executes (train's huge-pages restart):
# the package is then absent for the command as for an environment without it. (A stub
# package that raises ImportError would not do: find_spec would still find it.)
_HIDE = """import os, sys
for _name in filter(None, os.environ.get("JAXTRAIN_TEST_HIDE", "").split(",")):
    sys.modules[_name] = None
"""


def hidden_env(tmp_path, *names) -> dict:
    site = tmp_path / "hide"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HIDE)
    path = os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, JAXTRAIN_TEST_HIDE=",".join(names))


def test_train_without_a_sink_package_fails_in_one_line_and_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config", "configs/tiny.py",
                          "--config.metrics.sinks=jsonl,tensorboard", f"--workdir={workdir}"],
                         cwd=ROOT, env=hidden_env(tmp_path, "tensorboardX"), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "jaxtrain: error: metrics.sinks='jsonl,tensorboard': the tensorboard sink needs the "
        "tensorboardX package: pip install tensorboardX (a dependency of jaxtrain)"]
    assert not workdir.exists()
