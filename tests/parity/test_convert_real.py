"""Real checkpoints in, without friction (issue #47): the model config from config.json (no
--config), tied heads kept tied (one array, exported tied, counted once), the local Hugging
Face cache, generation_config.json, and an import that questions what it reads (a damaged
file, a non-finite tensor, tensors that map to nothing).

The models are tiny random transformers models of the shapes of real ones: Llama with GQA
and a tied head, Qwen3 (q/k norms) and Gemma 3 (sandwich norms, sliding layers) tied.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import assert_peft_loads_the_adapter
from hf_parity import hf_logits, jax_logits
from safetensors.numpy import load_file, save_file

from jaxtrain.commands.convert import hf_source, import_config
from jaxtrain.config import base_config
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.hf import FAMILIES, families_table, generation, hub, llama
from jaxtrain.hf.load import import_hf
from jaxtrain.hf.mapping import FLOAT_REL_TOL
from jaxtrain.hf.model_config import resolve
from jaxtrain.hf.save import export_hf, load_for_export
from jaxtrain.run_record import session_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # max |Δ logit|, float32
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=320,
             max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=1,
             eos_token_id=2)
KINDS = {  # transformers' config and model classes, and what each family adds
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"rope_theta": 1e5, "rms_norm_eps": 9.999999747378752e-06}),  # float32's 1e-5
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
}


def hf_model(kind: str, seed: int = 0, **changes):
    """A random tied transformers model of `kind` (norms around 1, so a misplaced tensor
    shows), float32, eval mode."""
    import torch
    import transformers

    config_class, model_class, extra = KINDS[kind]
    config = getattr(transformers, config_class)(**{**SHAPE, **extra, **changes})
    model = getattr(transformers, model_class)(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if name.endswith("norm.weight") and kind != "gemma3":  # Gemma's are 1 + w
                p.add_(1.0)
    return model.float().eval()


def tokens(batch: int = 2, length: int = 32):
    return np.random.default_rng(1).integers(0, SHAPE["vocab_size"], (batch, length))


def imported(directory, run, devices, **kwargs):
    """import as `convert --from-hf DIR --workdir RUN` does with no --config."""
    cfg = import_config(base_config(), pathlib.Path(directory), None)
    return cfg, *import_hf(cfg, directory, run, devices[:1], **kwargs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_tied_model_imports_without_a_config_and_exports_tied(kind, tmp_path, devices):
    """No --config: the model config is config.json's; the head is the embedding table (no
    lm_head parameter), so the count is transformers'; logits within 1e-5; the export is
    tied (no lm_head tensor, tie_word_embeddings true) and transformers' own tensors."""
    model = hf_model(kind)
    model.save_pretrained(tmp_path / "hf")
    cfg, setup, state = imported(tmp_path / "hf", tmp_path / "run", devices)
    assert cfg.model.family == kind and setup.spec.tied_embeddings
    assert "lm_head" not in state.params
    assert sum(x.size for x in jax.tree.leaves(state.params)) == model.num_parameters()
    want = hf_logits(model, tokens())
    assert np.abs(jax_logits(setup, state.params, tokens()) - want).max() < TOLERANCE
    export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "lm_head.weight" not in exported and exported.keys() == original.keys()
    assert all(np.array_equal(exported[k], original[k]) for k in original)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert (tmp_path / "out" / generation.FILE).read_text() == \
        (tmp_path / "hf" / generation.FILE).read_text()


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_import_trains_with_its_workdir_alone_and_stays_tied(kind, tmp_path, devices):
    """`train --workdir RUN --config.steps=2` (no --config): the recorded config; the
    trained model exports tied, and transformers gives its logits within 1e-5."""
    import transformers

    from jaxtrain.train.loop import run

    hf_model(kind).save_pretrained(tmp_path / "hf")
    imported(tmp_path / "hf", tmp_path / "run", devices)
    flags = base_config()
    flags.steps, flags.train.global_batch, flags.eval_batches = 2, 2, 1
    cfg = session_config(flags, tmp_path / "run", False,
                         {"steps", "train.global_batch", "eval_batches"})
    assert cfg.model.family == kind and cfg.model.d_model == 64 and cfg.steps == 2
    assert run(cfg, tmp_path / "run", devices[:1])[-1]["step"] == 2
    setup, params, step = load_for_export(tmp_path / "run", devices[:1])
    assert step == 2 and "lm_head" not in params
    export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    assert "lm_head.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.tie_word_embeddings
    assert again.num_parameters() == sum(x.size for x in jax.tree.leaves(params))
    err = np.abs(jax_logits(setup, params, tokens()) - hf_logits(again, tokens())).max()
    assert err < TOLERANCE, err


def test_the_planner_counts_a_tied_head_once():
    from jaxtrain.config import validate
    from jaxtrain.models import ModelSpec
    from jaxtrain.plan.memory import param_shards

    model = hf_model("llama")
    cfg = resolve(base_config(), model.config.to_dict(), FAMILIES["llama"])
    cfg.mesh.data = 1
    spec = ModelSpec.from_config(cfg)
    assert param_shards(spec, validate(cfg, 1))["count"] == model.num_parameters()


@pytest.mark.slow  # a LoRA run and PEFT on transformers
def test_peft_loads_an_adapter_trained_on_a_tied_import(tmp_path, devices):
    from conftest import small_config

    def config(**overrides):
        return small_config("llama", **{
            "model.num_heads": 4, "model.num_kv_heads": 2, "model.mlp_dim": 96,
            "model.vocab_size": 320, "model.norm_eps": 1e-6, "model.rope_theta": 1e5,
            "model.tie_embeddings": True, "model.attention": "xla", **overrides})

    def tied_llama(cfg):
        return hf_model("llama", rms_norm_eps=1e-6)

    assert_peft_loads_the_adapter(tmp_path, devices, config, tied_llama, "q,v",
                                  ["q_proj", "v_proj"])


# ---------------------------------------------------------------------------------------
# The config from config.json: given keys are checked, floats within a relative 1e-6.

def test_given_model_keys_are_checked_against_config_json(tmp_path, devices):
    model = hf_model("llama")
    model.save_pretrained(tmp_path / "hf")
    given = base_config()
    given.model.d_model, given.model.norm_eps = 32, 1e-5
    cfg = import_config(given, tmp_path / "hf", {"model.d_model", "model.norm_eps"})
    assert cfg.model.num_kv_heads == 2 and cfg.model.tie_embeddings
    with pytest.raises(ConfigError) as e:
        import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    message = str(e.value)
    assert "\n" not in message and "model.d_model=32 but config.json hidden_size=64" in message
    assert "norm_eps" not in message  # 1e-5 is 9.999999747378752e-06 within FLOAT_REL_TOL
    assert FLOAT_REL_TOL == 1e-6
    assert not llama.check_config(model.config.to_dict(), import_config(
        base_config(), tmp_path / "hf", None).model)


def test_an_imported_moe_model_runs_dropless_and_says_when_capacity_drops(tmp_path, capsys):
    import transformers

    hf = transformers.MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=96,
                                    vocab_size=320, num_local_experts=4).to_dict()
    cfg = resolve(base_config(), hf, FAMILIES["mixtral"])
    assert (cfg.model.family, cfg.model.moe.num_experts) == ("llama", 4)
    assert cfg.model.moe.dispatch == "dropless" and not cfg.model.tie_embeddings
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(cfg.to_json_best_effort())
    flags = base_config()
    flags.model.moe.dispatch = "capacity"
    again = session_config(flags, tmp_path / "run", False, {"model.moe.dispatch"})
    assert again.model.moe.dispatch == "capacity" and again.model.moe.num_experts == 4
    assert capsys.readouterr().err.count("drops the rest") == 1
    assert session_config(base_config(), tmp_path / "run", False, set()).model.moe.dispatch \
        == "dropless"
    assert "drops" not in capsys.readouterr().err


def test_train_without_a_config_needs_a_recorded_run(tmp_path):
    with pytest.raises(ConfigError, match="--config is required: --workdir=.* holds no"):
        session_config(base_config(), tmp_path / "empty", False, set())


# ---------------------------------------------------------------------------------------
# The local Hugging Face cache, offline.

def _cache(home: pathlib.Path, model_id: str, source: pathlib.Path) -> None:
    """The layout huggingface_hub writes: blobs, a snapshot of links to them, refs/main."""
    repo = home / "hub" / f"models--{model_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "c0ffee").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    for i, file in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(file.read_bytes())
        os.symlink(os.path.relpath(blob, repo / "snapshots" / "c0ffee"),
                   repo / "snapshots" / "c0ffee" / file.name)


def test_a_hub_id_imports_from_the_local_cache(tmp_path, devices, monkeypatch):
    model = hf_model("llama")
    model.save_pretrained(tmp_path / "hf")
    _cache(tmp_path / "home", "org/tiny-llama", tmp_path / "hf")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    directory = hf_source("org/tiny-llama")
    assert directory == hub.cache_dir() / "models--org--tiny-llama" / "snapshots" / "c0ffee"
    _, setup, state = imported(directory, tmp_path / "run", devices)
    assert sum(x.size for x in jax.tree.leaves(state.params)) == model.num_parameters()
    with pytest.raises(ConfigError) as e:
        hf_source("org/missing")
    assert "\n" not in str(e.value) and "`hf download org/missing`" in str(e.value)
    assert "huggingface-cli download org/missing" in str(e.value)


# ---------------------------------------------------------------------------------------
# An import questions what it reads: each of these imported (or crashed) before.

def _probe(tmp_path, name: str, change) -> pathlib.Path:
    """A copy of a tiny tied Llama's directory with `change(tensors dict)` saved, or with
    its safetensors file given to `change` as a path when `change` takes one."""
    directory = tmp_path / name
    hf_model("llama").save_pretrained(directory)
    change(directory / "model.safetensors")
    return directory


def _nothing_written(run: pathlib.Path) -> bool:
    return not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_a_truncated_safetensors_file_is_named(tmp_path, devices):
    def truncate(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    directory = _probe(tmp_path, "truncated", truncate)
    with pytest.raises(DataError) as e:
        imported(directory, tmp_path / "run", devices)
    assert "\n" not in str(e.value)
    assert f"{directory / 'model.safetensors'} is not a readable safetensors file" in \
        str(e.value)
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_non_finite_tensor_is_named(tmp_path, devices):
    def poison(path):
        tensors = load_file(str(path))
        tensors["model.layers.1.self_attn.k_proj.weight"][3, 5] = np.nan
        save_file(tensors, str(path), metadata={"format": "pt"})

    directory = _probe(tmp_path, "nan", poison)
    with pytest.raises(DataError, match="tensor model.layers.1.self_attn.k_proj.weight holds "
                       "non-finite values"):
        imported(directory, tmp_path / "run", devices)
    assert _nothing_written(tmp_path / "run")
    assert not (tmp_path / "run" / "config.json").exists()


def test_tensors_that_map_to_nothing_are_listed_and_refused(tmp_path, devices):
    def extend(path):
        tensors = load_file(str(path))
        tensors["model.layers.0.mlp.extra_proj.weight"] = np.ones((4, 4), np.float32)
        save_file(tensors, str(path), metadata={"format": "pt"})

    directory = _probe(tmp_path, "unused", extend)
    with pytest.raises(ConfigError) as e:
        imported(directory, tmp_path / "run", devices)
    assert "\n" not in str(e.value)
    assert "holds 1 tensors that map to no parameter of the model: " \
           "model.layers.0.mlp.extra_proj.weight; pass --allow-unused" in str(e.value)
    assert _nothing_written(tmp_path / "run")
    _, _, state = imported(directory, tmp_path / "run", devices, allow_unused=True)
    assert "lm_head" not in state.params


def test_a_generation_config_that_is_no_ids_is_refused(tmp_path, devices):
    model = hf_model("llama")
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / generation.FILE).write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ConfigError, match="eos_token_id='</s>' must be a token id"):
        imported(tmp_path / "hf", tmp_path / "run", devices)


# ---------------------------------------------------------------------------------------
# Every family, named by the registry, in convert --help and docs/interop.md.

def test_convert_help_and_the_docs_name_every_family():
    result = subprocess.run([sys.executable, "-m", "jaxtrain.commands.convert", "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    for model_type, module in FAMILIES.items():
        assert model_type in result.stdout and module.ARCHITECTURE in result.stdout
    assert families_table() in (ROOT / "docs" / "interop.md").read_text()


def test_every_family_builds_its_config_from_config_json():
    """No --config for any family: the config read from config.json passes the import's
    checks of it (the one table, read both ways)."""
    import transformers

    from jaxtrain.hf.load import _check_matches

    small = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 vocab_size=320, intermediate_size=96)
    gqa = dict(small, num_key_value_heads=2)
    experts = dict(gqa, head_dim=16, num_experts_per_tok=2)
    configs = {
        "gpt2": transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=320),
        "llama": transformers.LlamaConfig(**gqa, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}),
        "mixtral": transformers.MixtralConfig(**gqa, num_local_experts=4, sliding_window=16),
        "qwen2": transformers.Qwen2Config(**gqa, use_sliding_window=True, sliding_window=8,
                                          max_window_layers=1),
        "qwen3": transformers.Qwen3Config(**gqa, head_dim=16),
        "mistral": transformers.MistralConfig(**gqa, sliding_window=8),
        "gemma3_text": transformers.Gemma3TextConfig(**gqa, head_dim=16, sliding_window=8),
        "gemma2": transformers.Gemma2Config(**gqa, head_dim=16, sliding_window=8),
        "qwen3_moe": transformers.Qwen3MoeConfig(**experts, num_experts=4,
                                                 moe_intermediate_size=32),
        "gpt_oss": transformers.GptOssConfig(**experts, num_local_experts=4, sliding_window=8),
        "deepseek_v3": transformers.DeepseekV3Config(
            **small, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
            q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    }
    for model_type, config in configs.items():
        hf = config.to_dict()
        cfg = resolve(base_config(), hf, FAMILIES[model_type])
        _check_matches(cfg, hf, FAMILIES[model_type], pathlib.Path(model_type))
        assert cfg.model.d_model == 64, model_type
    assert resolve(base_config(), configs["gemma2"].to_dict(), FAMILIES["gemma2"]) \
        .model.layer_types == "sliding,full,sliding"


@pytest.mark.slow  # three CLI runs
def test_the_cli_imports_trains_and_exports_with_no_config(tmp_path):
    """`convert --from-hf DIR --workdir RUN`, `train --workdir RUN --config.steps=2`,
    `convert --to-hf OUT --workdir RUN`: no --config anywhere; a --config whose model key
    disagrees is refused in one line naming both values."""
    model = hf_model("qwen3")
    model.save_pretrained(tmp_path / "hf")
    run, env = tmp_path / "run", {**os.environ, "PYTHONPATH": str(ROOT),
                                  "JAXTRAIN_HUGE_PAGES": "0"}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "jaxtrain", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)

    result = cli("convert", f"--from-hf={tmp_path / 'hf'}", f"--workdir={tmp_path / 'bad'}",
                 "--config=configs/tiny.py")
    assert result.returncode == 2
    assert "model.num_layers=4 but config.json num_hidden_layers=2" in \
        result.stderr.strip().splitlines()[-1]
    result = cli("convert", f"--from-hf={tmp_path / 'hf'}", f"--workdir={run}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"({model.num_parameters():,} parameters)" in result.stderr
    result = cli("train", f"--workdir={run}", "--config.steps=2", "--config.eval_batches=1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run / "checkpoints" / "2").is_dir()
    result = cli("convert", f"--to-hf={tmp_path / 'out'}", f"--workdir={run}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"]
