"""Config errors are caught before compiling, with one line naming the key."""

import ast
import pathlib
import subprocess
import sys

import pytest
from conftest import small_config

from jaxtrain.config import ConfigError, load_config_file, validate

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides,devices,message", [
    ({"mesh.data": 3}, 8, "mesh='data=3' is invalid: the mesh axes must multiply to the 8 devices"),
    ({"mesh.data": -1, "mesh.fsdp": -1}, 8, "mesh.fsdp=-1 is invalid: only one axis may be -1"),
    ({"mesh.data": -1, "mesh.tensor": 3}, 8, "mesh.data=-1 is invalid: the other axes multiply to 3"),
    ({"mesh.data": 2, "mesh.tensor": 4, "model.num_heads": 6, "model.d_model": 96}, 8,
     "model.num_heads=6 is invalid: must be divisible by mesh.tensor=4"),
    ({"mesh.data": 1, "mesh.tensor": 8, "model.family": "llama", "model.num_kv_heads": 4}, 8,
     "model.num_kv_heads=4 is invalid: must be divisible by mesh.tensor=8"),
    ({"mesh.data": 8, "train.global_batch": 12}, 8,
     "train.global_batch=12 is invalid: each of the 1 micro-batches (12 sequences) must divide by mesh.data×mesh.fsdp×mesh.expert=8"),
    ({"train.microbatches": 3}, 1, "train.microbatches=3 is invalid: must divide train.global_batch=16"),
    ({"mesh.fsdp": 8, "mesh.data": 1, "model.d_model": 60, "model.num_heads": 6}, 8,
     "model.d_model=60 is invalid: must be divisible by mesh.fsdp=8"),
    ({"model.family": "gpt3"}, 1, "model.family='gpt3' is invalid: valid values are gpt2, llama"),
    ({"model.remat": "some"}, 1, "model.remat='some' is invalid: valid values are none, full, save_dots"),
    ({"train.precision": "fp64"}, 1, "train.precision='fp64' is invalid: valid values are"),
    ({"model.sliding_window": -1}, 1, "model.sliding_window=-1 is invalid: must be 0 (off)"),
    ({"model.num_kv_heads": 3}, 1, "model.num_kv_heads=3 is invalid: must divide model.num_heads=8"),
    ({"data.source": "bin"}, 1, "data.path='' is invalid: data.source='bin' needs"),
    # A path for a source that reads none (the default stdlib corpus) would be ignored.
    ({"data.path": "ds"}, 1, "data.path='ds' is invalid: data.source='stdlib' reads no path "
     "(it would train on the bytes of this Python's standard library sources); data.path is "
     "read by data.source='bin' or 'prepared' or 'prompts': set data.source, or drop "
     "data.path"),
    ({"data.path": "ds", "data.source": "synthetic"}, 1,
     "data.path='ds' is invalid: data.source='synthetic' reads no path"),
    ({"model.vocab_size": 100}, 1, "model.vocab_size=100 is invalid: the byte-level stdlib corpus needs >= 256"),
    ({"mesh.pipeline": 4, "mesh.data": 2, "model.num_layers": 6}, 8,
     "model.num_layers=6 is invalid: must divide into mesh.pipeline×pipeline.repeats=4×1 "
     "equal stages: use 4 or 8"),
    ({"mesh.pipeline": 2, "mesh.data": 4, "pipeline.schedule": "circular",
      "pipeline.repeats": 2, "model.num_layers": 6}, 8,
     "model.num_layers=6 is invalid: must divide into mesh.pipeline×pipeline.repeats=2×2 "
     "equal stages: use 4 or 8; or pipeline.repeats in [3]"),
    ({"mesh.pipeline": 4, "mesh.data": 2, "pipeline.schedule": "circular",
      "pipeline.repeats": 2, "pipeline.microbatches": 2, "model.num_layers": 8}, 8,
     "pipeline.microbatches=2 is invalid: the circular schedule needs at least "
     "mesh.pipeline=4 micro-batches"),
    ({"pipeline.repeats": 2}, 1, "pipeline.repeats=2 is invalid: the gpipe schedule has one "
     "chunk per stage"),
    ({"mesh.pipeline": 2, "mesh.data": 4, "pipeline.microbatches": 4, "train.global_batch": 8}, 8,
     "train.global_batch=8 is invalid: each of the 1 micro-batches (8 sequences) must divide "
     "by mesh.data×mesh.fsdp×mesh.expert×pipeline.microbatches=16"),
])
def test_config_errors_name_the_key(overrides, devices, message):
    with pytest.raises(ConfigError) as error:
        validate(small_config(**overrides), devices)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_minus_one_fills_the_rest():
    sizes = validate(small_config(**{"mesh.data": -1, "mesh.tensor": 2}), 8)
    assert sizes == {"data": 4, "pipeline": 1, "fsdp": 1, "tensor": 2, "expert": 1, "context": 1}


def _load(path):
    return load_config_file(path)


# Each shipped config on the device count it is written for.
SHIPPED = {"tiny": 1, "stdlib_bpe": 1, "bench_cpu": 1, "gpt2_124m": 8, "llama_1b": 1,
           "llama_1b_32k": 8,
           "gpt13b": 64, "gpt13b_pp": 16, "tiny_moe": 1, "bench_cpu_moe": 1, "mixtral_8x7b": 64,
           "stdlib_sft": 1, "stdlib_dpo": 1, "tiny_qwen3": 1, "tiny_gemma3": 1,
           "qwen3_8b": 8, "qwen3_30b_a3b": 16, "gemma3_12b": 16, "gpt_oss_20b": 16,
           "tiny_deepseek": 1, "deepseek_v3_671b": 1024, "tiny_qwen3_5": 1}


@pytest.mark.parametrize("name,devices", SHIPPED.items())
def test_shipped_configs_validate(name, devices):
    cfg = _load(ROOT / "configs" / f"{name}.py")
    assert cfg.name == name
    validate(cfg, devices)


def test_every_config_is_covered():
    # configs/_*.py are the bases the configs load (_cluster.py ...), not runs of their own.
    assert {p.stem for p in (ROOT / "configs").glob("[!_]*.py")} == set(SHIPPED)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.name)
def test_a_config_extends_another_only_through_load_config_file(path):
    """A config starts from base_config() or loads its parent with load_config_file, as
    --config does; none imports another config, or loads one with importlib, itself."""
    source = path.read_text()
    assert ("base_config()" in source) != ("load_config_file(" in source)
    imported = {alias.name if isinstance(node, ast.Import) else node.module
                for node in ast.walk(ast.parse(source))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    assert imported <= {"pathlib", "jaxtrain.config"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxtrain.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_reports_config_error_in_one_line(tmp_path):
    out = _cli("--config", "configs/tiny.py", "--config.model.num_heads=3",
               f"--workdir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "jaxtrain: error: model.num_heads=3 is invalid: must divide model.d_model=128 "
        "(or set model.head_dim)")
    assert not (tmp_path / "run").exists(), "nothing is written for a bad config"


@pytest.mark.parametrize("arg,message", [
    ("--config.model.heads=4", "jaxtrain: error: --config.model.heads: there is no key "
     "'heads' under model; valid: attention, attention_scale_dim, attn_logit_softcap, "
     "context_attention, d_model,"),
    ("--config.steps=ten", "jaxtrain: error: flag --config.steps=ten: invalid literal for "
     "int()"),
])
def test_cli_rejects_unknown_keys_and_wrong_types(arg, message, tmp_path):
    out = _cli("--config", "configs/tiny.py", arg, f"--workdir={tmp_path / 'run'}")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], "one line, no traceback"
    assert out.stderr.startswith(message)
    assert not (tmp_path / "run").exists()
