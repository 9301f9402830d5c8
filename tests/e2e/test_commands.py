"""What every command does the same way: a missing optional package, an object-storage path
and --help each end in one line (or the command's own help) before anything is written."""

import importlib.machinery
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from conftest import small_config
from helpers import run_commands

from jaxtrain import errors
from jaxtrain.commands import COMMANDS, prepare
from jaxtrain.config import validate
from jaxtrain.errors import JaxtrainError

ROOT = pathlib.Path(__file__).resolve().parents[2]


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


# Runs `jaxtrain ARGS...` for each argv in one subprocess, in-process one after another: absl
# keeps the flags a command defines in one global registry, so those are removed before
# the next command defines its own (several define --workdir). One process: the imports
# (jax) are paid once for every command.
# Every path a command takes that is local-only for now, as an object-storage URL (the
# others local and valid). --workdir may be on object storage in every command
# (tests/storage/test_object_storage.py; launch's, for several processes: tests/e2e/test_multihost.py).
CONFIG = str(ROOT / "configs" / "tiny.py")
URL_CASES = [
    (["train", "--config", CONFIG, "--config.eval.task_dir=gs://bucket/tasks",
      "--workdir", "run"], "eval.task_dir=gs://bucket/tasks"),
    (["eval", "--workdir", "run", "--data", "gs://bucket/val.bin"], "--data=gs://bucket/val.bin"),
    (["eval", "--workdir", "run", "--tasks", "arc_easy,https://host/task.yaml"],
     "--tasks=https://host/task.yaml"),
    (["eval", "--workdir", "run", "--tasks", "t", "--task_dir", "gs://bucket/tasks"],
     "--task_dir=gs://bucket/tasks"),
    (["plan", "--config", CONFIG, "--hardware", "A100-80GB", "--hardware-file", "gs://b/h.json"],
     "--hardware-file=gs://b/h.json"),
]


def test_local_only_paths_refuse_object_storage_in_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "run").mkdir()  # an empty run: whatever reads it would fail otherwise
    results = run_commands([argv for argv, _ in URL_CASES], tmp_path)
    # convert, quantize, report, prepare: every path may be on object storage
    assert {argv[0] for argv, _ in URL_CASES} == set(COMMANDS) - {
        "generate", "serve", "convert", "launch", "quantize", "report", "prepare"}
    for (argv, where), (code, _, err) in zip(URL_CASES, results):
        assert code == 2, (argv, err[-2000:])
        assert err.strip().startswith(f"jaxtrain: error: {where}: "), (argv, err)
        assert "not supported yet" in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "run"], "nothing written"
    assert not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("key,value", [  # data.path, val_path, mixture: test_remote_data.py
    ("checkpoint.local_dir", "gs://b/fast"),
    ("eval.tasks", "arc_easy,gs://b/t.yaml"), ("eval.task_dir", "gs://b/tasks"),
])
def test_config_paths_are_local(key, value):
    with pytest.raises(JaxtrainError, match=r"gs://|s3://") as error:
        validate(small_config(**{key: value}), 1, "cpu")
    assert str(error.value).startswith(f"{key}=") and "not supported yet" in str(error.value)


# Each command's own flags, a few of them: what its --help must list.
OWN_FLAGS = {
    "train": ["--config", "--workdir", "--coordinator", "--config.steps", "--config.optimizer.lr"],
    "prepare": ["--out", "--tokenizer", "--train-tokenizer", "--shard", "--merge"],
    "plan": ["--config", "--hardware", "--devices", "--search", "--compile"],
    "generate": ["--workdir", "--prompt", "--prompt_ids", "--max_new_tokens", "--temperature",
                 "--chat", "--prompts"],
    "serve": ["--workdir", "--host", "--port", "--api_key", "--slots"],
    "eval": ["--workdir", "--data", "--tasks", "--task_dir", "--out"],
    "quantize": ["--workdir", "--out", "--calibration_batches", "--int8_activations"],
    "convert": ["--from-hf", "--to-hf", "--workdir", "--config", "--dtype"],
    "report": ["--workdir", "--out"],
    "launch": ["--processes", "--devices-per-process", "--max-restarts"],
}


def test_every_command_lists_its_own_flags_for_help(tmp_path):
    assert set(OWN_FLAGS) == set(COMMANDS)
    names = list(OWN_FLAGS)
    results = run_commands([[name, "--help"] for name in names] + [["generate", "-h"]], tmp_path)
    for name, (code, out, err) in zip(names + ["generate"], results):
        assert code == 0, (name, err[-2000:])
        for flag in OWN_FLAGS[name]:
            assert flag in out, (name, flag, out)
        assert "--helpfull" not in out and "--logtostderr" not in out, (name, out)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_folders_a_command_may_not_write_into_are_refused_in_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"line {i} of a small corpus\n" for i in range(300)))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}\n")  # a lone file: not empty
    results = run_commands([
        ["prepare", "a.txt", "--out", "ds", "--tokenizer", "bytes", "--no-progress"],
        ["train", "--config", CONFIG, "--config.steps=2", "--workdir", "ds"],
        ["train", "--config", CONFIG, "--config.steps=2", "--workdir", "notes"],
        ["train", "--config", CONFIG, "--config.data.path=ds", "--workdir", "run"],
        ["convert", "--to-hf", "hf", "--workdir", "run"],
    ], tmp_path)
    assert results[0][0] in (0, None), results[0][2][-2000:]
    dataset = {p: p.stat().st_mtime_ns for p in (tmp_path / "ds").rglob("*")}
    expected = [
        "--workdir=ds holds a prepared dataset (manifest.json), not a run: a run would "
        "overwrite its tokenizer/; give a new or empty folder, or an existing run's",
        "--workdir=notes is not a run directory: it holds todo.txt and none of a run's files "
        "(checkpoints, checkpoint_manifests, data.json, metrics.jsonl, ...); give a new or "
        "empty folder, or an existing run's",
        "data.path='ds' is invalid: data.source='stdlib' reads no path (it would train on the "
        "bytes of this Python's standard library sources); data.path is read by "
        "data.source='bin' or 'prepared' or 'prompts': set data.source, or drop data.path",
        "--to-hf=hf is not empty (it holds tokenizer.json); export into a new or empty folder",
    ]
    for message, (code, _, err) in zip(expected, results[1:]):
        assert code == 2, err[-2000:]
        assert err.strip().splitlines() == [f"jaxtrain: error: {message}"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "ds").rglob("*")} == dataset
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["todo.txt"]
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["tokenizer.json"]
    assert not (tmp_path / "run").exists()


def test_a_dataset_whose_tokenizer_was_overwritten_is_refused(tmp_path):
    from jaxtrain.data import record
    from jaxtrain.data.tokenizers import ByteTokenizer
    from jaxtrain.errors import ConfigError, DataError
    from jaxtrain.prepare import pipeline
    from jaxtrain.workdir import prepare_workdir

    (tmp_path / "in").mkdir()
    for i in range(40):
        (tmp_path / "in" / f"{i}.txt").write_text(f"hello world number {i} " * 5)
    ds = tmp_path / "bpe"
    pipeline.prepare(pipeline.Request.build(inputs=[str(tmp_path / "in")], out=str(ds),
                                            progress=False, processes=1, tokenizer=None,
                                            train_tokenizer=300))
    cfg = small_config(**{"data.source": "prepared", "data.path": str(ds),
                          "model.vocab_size": 512})
    assert record.run_data(cfg)[1].kind == "huggingface"  # the manifest's own: accepted
    with pytest.raises(ConfigError, match=r"holds a prepared dataset \(manifest.json\), not a "
                       "run"):
        prepare_workdir(ds)
    # What a run used to leave there when given the dataset as its --workdir.
    shutil.rmtree(ds / "tokenizer")
    ByteTokenizer().save(ds / "tokenizer")
    with pytest.raises(DataError) as error:
        record.run_data(cfg)
    assert re.fullmatch(
        rf"data.path: {ds}/tokenizer holds the tokenizer bytes \(UTF-8, 256 ids\), but the "
        r"dataset's manifest records huggingface \(\d+ ids, sha256 [0-9a-f]{12}\), which made "
        r"its ids: put back the tokenizer/ the prepare wrote, or prepare the data again",
        str(error.value)), str(error.value)


def test_wandb_online_without_an_api_key_is_refused_before_the_run_starts(monkeypatch,
                                                                         tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = {"metrics.sinks": "jsonl,wandb"}
    with pytest.raises(JaxtrainError) as error:
        validate(small_config(**cfg), 1, "cpu")
    assert str(error.value) == (
        "metrics.sinks='jsonl,wandb': W&B online mode needs an API key and none is set "
        "(WANDB_API_KEY, or `wandb login`, which writes ~/.netrc); or set "
        "metrics.wandb.mode=offline (no key needed)")
    validate(small_config(**cfg, **{"metrics.wandb.mode": "offline"}), 1, "cpu")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password "
                                    + "k" * 40 + "\n")
    validate(small_config(**cfg), 1, "cpu")  # what `wandb login` writes
    (tmp_path / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    validate(small_config(**cfg), 1, "cpu")
