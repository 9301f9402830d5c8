"""Hugging Face import/export (jaxtrain/commands/convert.py) against transformers' own models, on CPU.

torch and transformers come with the `test` extra and are imported inside the tests only.
"""

import dataclasses
import json
import os
import pathlib
import stat
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import small_config
from flax import nnx, traverse_util
from hf_parity import hf_logits, jax_logits, random_tokens

from jaxtrain.config import ConfigError
from jaxtrain.hf.load import import_hf
from jaxtrain.hf.save import export_hf, load_for_export
from jaxtrain.models import Transformer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # max |Δ logit|, float32


def _config(family: str, **overrides):
    extra = {"model.num_heads": 4, "model.num_kv_heads": 2, "model.norm_eps": 1e-6} \
        if family == "llama" else {}
    return small_config(family, **{**extra, **overrides})


def _hf_model(cfg, seed: int = 0, **extra):
    """A transformers model of cfg's shape with random weights (norms around 1, biases and
    positions non-zero, so that a misplaced tensor shows)."""
    import torch
    import transformers

    m = cfg.model
    if m.family == "gpt2":
        config = transformers.GPT2Config(**{
            "n_embd": m.d_model, "n_layer": m.num_layers, "n_head": m.num_heads,
            "n_inner": m.mlp_dim, "vocab_size": m.vocab_size, "n_positions": m.seq_len,
            "layer_norm_epsilon": m.norm_eps, "bos_token_id": 0, "eos_token_id": 0, **extra})
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=m.d_model, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads or m.num_heads,
            intermediate_size=m.mlp_dim, vocab_size=m.vocab_size,
            max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
            rope_theta=m.rope_theta, bos_token_id=0, eos_token_id=0, **extra)
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if name.endswith("weight") and ("ln_" in name or "norm" in name):
                p.add_(1.0)
    return model.eval()


def _numpy(params):
    return traverse_util.flatten_dict(jax.tree.map(np.asarray, params))


@pytest.mark.parametrize("family,shard,extra", [
    ("gpt2", "20KB", {"n_positions": 64}),  # wpe longer than model.seq_len=32
    ("llama", None, {}),
    ("llama", "30KB", {"tie_word_embeddings": True}),
], ids=["gpt2-sharded", "llama-gqa", "llama-tied-sharded"])
def test_import_gives_the_logits_of_transformers(family, shard, extra, tmp_path, devices):
    cfg = _config(family)
    model = _hf_model(cfg, **extra)
    model.save_pretrained(tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == bool(shard)
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    tokens = random_tokens(cfg)
    err = np.abs(jax_logits(setup, state.params, tokens) - hf_logits(model, tokens)).max()
    assert err < TOLERANCE, err
    assert (tmp_path / "run" / "checkpoints" / "0").is_dir()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["family"] == family


def test_import_onto_a_mesh_places_the_same_values(tmp_path, devices):
    cfg = _config("llama")
    model = _hf_model(cfg)
    model.save_pretrained(tmp_path / "hf")
    _, single = import_hf(cfg, tmp_path / "hf", tmp_path / "single", devices[:1])
    sharded_cfg = _config("llama", **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    setup, state = import_hf(sharded_cfg, tmp_path / "hf", tmp_path / "mesh", devices)
    w_q = state.params["blocks"]["attn"]["w_q"]
    assert w_q.sharding.spec == setup.shardings.params["blocks"]["attn"]["w_q"].spec
    assert len(w_q.addressable_shards[0].data.reshape(-1)) == w_q.size // 4  # fsdp×tensor
    a, b = _numpy(single.params), _numpy(state.params)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    tokens = random_tokens(cfg)
    err = np.abs(jax_logits(setup, state.params, tokens) - hf_logits(model, tokens)).max()
    assert err < TOLERANCE, err
    # Layers sharded over a pipeline axis are stacked into their stages.
    piped = _config("llama", **{"mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    _, state = import_hf(piped, tmp_path / "hf", tmp_path / "pipe", devices)
    assert "pipeline" in str(state.params["blocks"]["mlp"]["w_up"].sharding.spec)
    b = _numpy(state.params)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_import_export_import_is_exact(family, tmp_path, devices):
    from safetensors.numpy import load_file

    cfg = _config(family)
    _hf_model(cfg).save_pretrained(tmp_path / "hf")
    _, first = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    files = export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    # generation_config.json: the one save_pretrained wrote, kept by the import.
    assert files == ["config.json", "model.safetensors", "generation_config.json"]
    _, second = import_hf(cfg, tmp_path / "out", tmp_path / "again", devices[:1])
    a, b = _numpy(first.params), _numpy(second.params)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # And the exported tensors are transformers' own, bit for bit (lm_head: tied in GPT-2).
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(np.array_equal(exported[k], original[k]) for k in original)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_trained_model_exports_to_transformers(family, tmp_path, devices):
    import transformers

    from jaxtrain.train.loop import run

    cfg = _config(family, **{"model.norm_eps": 1e-6, "model.rope_theta": 50000.0})
    run(cfg, tmp_path / "run", devices[:1])  # 3 steps from a fresh init
    files = export_hf(tmp_path / "run", tmp_path / "out", max_shard_size="40KB",
                      devices=devices[:1])
    assert "model.safetensors.index.json" in files and len(files) > 3
    umask = os.umask(0)
    os.umask(umask)
    for name in files:  # readable like any file this process makes (safetensors: 0600)
        assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == 0o666 & ~umask, name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    setup, params, step = load_for_export(tmp_path / "run", devices[:1])
    assert step == 3
    tokens = random_tokens(cfg)
    err = np.abs(jax_logits(setup, params, tokens) - hf_logits(model, tokens)).max()
    assert err < TOLERANCE, err
    hf = model.config
    if family == "gpt2":
        assert (hf.activation_function, hf.layer_norm_epsilon) == ("gelu_new", 1e-6)
        assert hf.n_positions == cfg.model.seq_len and hf.tie_word_embeddings
    else:
        theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") \
            or hf.rope_theta
        assert (hf.hidden_act, hf.rms_norm_eps, theta) == ("silu", 1e-6, 50000.0)
        assert hf.num_key_value_heads == 2 and not hf.tie_word_embeddings


def test_gpt2_saved_without_the_transformer_prefix_imports(tmp_path, devices):
    """As openai-community/gpt2 is stored: `h.0.attn...`, `wte.weight`, plus attention-mask
    buffers (`h.0.attn.bias`) that are not parameters."""
    import shutil

    from safetensors.numpy import load_file, save_file

    cfg = _config("gpt2")
    _hf_model(cfg).save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    bare.update({f"h.{i}.attn.bias": np.ones((1, 1, 32, 32), np.float32) for i in range(2)})
    (tmp_path / "bare").mkdir()
    save_file(bare, str(tmp_path / "bare" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "bare")
    _, first = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    _, second = import_hf(cfg, tmp_path / "bare", tmp_path / "again", devices[:1])
    a, b = _numpy(first.params), _numpy(second.params)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_bfloat16_export_imports_back_rounded(tmp_path, devices):
    import ml_dtypes

    cfg = _config("llama")
    _hf_model(cfg).save_pretrained(tmp_path / "hf")
    _, first = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    export_hf(tmp_path / "run", tmp_path / "out", dtype="bfloat16", devices=devices[:1])
    _, second = import_hf(cfg, tmp_path / "out", tmp_path / "again", devices[:1])
    a, b = _numpy(first.params), _numpy(second.params)
    assert all(np.array_equal(a[k].astype(ml_dtypes.bfloat16).astype(np.float32), b[k])
               for k in a)


def test_the_training_loop_resumes_from_an_import(tmp_path, devices):
    from jaxtrain.data.batches import make_batches, to_global
    from jaxtrain.train.evaluation import evaluate_batches
    from jaxtrain.train.loop import run

    cfg = _config("gpt2", steps=2)
    _hf_model(cfg).save_pretrained(tmp_path / "hf")
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    with jax.set_mesh(setup.mesh):
        eval_step = setup.eval_step()
        imported = evaluate_batches(eval_step, state.params, [
            to_global(b, setup.tokens_sharding) for b in make_batches(cfg).val_batches()])[0]["loss"]
    rows = run(cfg, tmp_path / "run", devices[:1])
    assert [r["step"] for r in rows] == [1, 2]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert logged[0]["step"] == 0
    np.testing.assert_allclose(logged[0]["val_loss"], imported, rtol=1e-6)
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()


def test_mismatches_are_one_line_errors_before_any_tensor_is_read(tmp_path, devices):
    cfg = _config("gpt2")
    _hf_model(cfg).save_pretrained(tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())

    def attempt(name, **changes):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**hf, **changes}))
        os.symlink(tmp_path / "hf" / "model.safetensors", directory / "model.safetensors")
        with pytest.raises(ConfigError) as e:
            import_hf(cfg, directory, tmp_path / f"run_{name}", devices[:1])
        assert "\n" not in str(e.value)
        return str(e.value)

    message = attempt("wider", n_embd=128, n_layer=3)
    assert "model.d_model=64 but config.json n_embd=128" in message
    assert "model.num_layers=2 but config.json n_layer=3" in message
    assert "model.mlp_dim=128 but config.json n_inner" not in message
    assert "activation_function='gelu' is not supported" in attempt(
        "erf", activation_function="gelu")
    assert "model_type='mistral'" in attempt("mistral", model_type="mistral",
                                             architectures=["MistralForCausalLM"])
    # Consistent configs whose tensors disagree: caught from the safetensors headers.
    message = attempt("inner", n_inner=256)
    assert "model.mlp_dim=128 but config.json n_inner=256" in message
    cfg.model.mlp_dim = 256
    assert "unexpected shapes: transformer.h.0.mlp.c_fc.weight [64, 128] (expected " \
           "[64, 256])" in attempt("shapes", n_inner=256)
    assert not list(tmp_path.glob("run_*/checkpoints"))

    windowed = _config("gpt2", **{"model.sliding_window": 8})
    with pytest.raises(ConfigError, match="model.sliding_window=8 but gpt2 attends to every"):
        import_hf(windowed, tmp_path / "hf", tmp_path / "run_windowed", devices[:1])

    llama = _config("llama")
    _hf_model(llama, rope_scaling={"rope_type": "linear", "factor": 2.0}).save_pretrained(
        tmp_path / "scaled")
    with pytest.raises(ConfigError, match="rope_type='linear' is not supported"):
        import_hf(llama, tmp_path / "scaled", tmp_path / "run_scaled", devices[:1])


def test_cli_errors_are_one_line_with_a_nonzero_exit(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxtrain.commands.convert", f"--from-hf={tmp_path / 'missing'}",
         "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        f"jaxtrain: error: --from-hf={tmp_path / 'missing'}: no such directory"


# ---------------------------------------------------------------------------------------
# Mixtral: a llama with model.moe <-> MixtralForCausalLM.

def _mixtral_config(**overrides):
    return _config("llama", **{"model.moe.num_experts": 4, "model.moe.top_k": 2,
                               "model.moe.expert_mlp_dim": 96, "model.moe.dispatch": "dropless",
                               "model.rope_theta": 1e6, **overrides})


def _hf_mixtral(cfg, seed: int = 0, **extra):
    """A random transformers Mixtral of cfg's shape (norms around 1, router logits spread so
    that top-2 choices are not decided by float noise)."""
    import torch
    import transformers

    m = cfg.model
    config = transformers.MixtralConfig(
        hidden_size=m.d_model, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, intermediate_size=m.moe.expert_mlp_dim,
        num_local_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k,
        vocab_size=m.vocab_size, max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta, bos_token_id=0, eos_token_id=0, **extra)
    model = transformers.MixtralForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "gate.weight" in name else 0.1)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    return model.eval()


def test_mixtral_import_gives_the_logits_of_transformers(tmp_path, devices):
    cfg = _mixtral_config()
    model = _hf_mixtral(cfg)
    model.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    assert state.params["moe_blocks"]["mlp"]["w_up"].shape == (2, 4, 64, 96)
    tokens = random_tokens(cfg)
    err = np.abs(jax_logits(setup, state.params, tokens) - hf_logits(model, tokens)).max()
    assert err < TOLERANCE, err
    # The capacity path with room for every token, on an expert-parallel mesh, too.
    sharded = _mixtral_config(**{"model.moe.dispatch": "capacity",
                                 "model.moe.capacity_factor": 2.0, "mesh.expert": 4,
                                 "mesh.fsdp": 2})
    setup, state = import_hf(sharded, tmp_path / "hf", tmp_path / "mesh", devices)
    err = np.abs(jax_logits(setup, state.params, tokens) - hf_logits(model, tokens)).max()
    assert err < TOLERANCE, err


def test_mixtral_import_export_import_is_exact(tmp_path, devices):
    from safetensors.numpy import load_file

    cfg = _mixtral_config()
    _hf_mixtral(cfg).save_pretrained(tmp_path / "hf")
    _, first = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    _, second = import_hf(cfg, tmp_path / "out", tmp_path / "again", devices[:1])
    a, b = _numpy(first.params), _numpy(second.params)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(np.array_equal(exported[k], original[k]) for k in original)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["intermediate_size"]) \
        == ("mixtral", 4, 96)


def test_mixtral_greedy_generation_equals_transformers(tmp_path, devices):
    from helpers import assert_greedy_decode_equals_transformers

    cfg = _mixtral_config(**{"train.global_batch": 1})
    model = _hf_mixtral(cfg, seed=2)
    model.save_pretrained(tmp_path / "hf")
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    assert_greedy_decode_equals_transformers(setup, state, model, new_tokens=16)


@pytest.mark.slow
def test_a_trained_moe_model_exports_to_transformers(tmp_path, devices):
    import transformers

    from jaxtrain.train.loop import run

    cfg = _mixtral_config(**{"model.moe.dispatch": "capacity"})
    run(cfg, tmp_path / "run", devices[:1])  # 3 steps from a fresh init
    # The routing metrics reach metrics.jsonl, each step (the loop's rows, as written).
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 3 and all(
        {"moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min",
         "moe_dropped_fraction"} <= r.keys() for r in trained)
    assert all(r["moe_load_max"] >= r["moe_load_min"] >= 0.0 for r in trained)
    export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(model).__name__ == "MixtralForCausalLM"
    setup, params, _ = load_for_export(tmp_path / "run", devices[:1])
    tokens = random_tokens(cfg)
    # Compared without drops: the exported model is the same function as dropless routing.
    spec = dataclasses.replace(setup.spec, moe=dataclasses.replace(setup.spec.moe,
                                                                   dispatch="dropless"))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0))))
    with jax.set_mesh(setup.mesh):
        ours = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))
    err = np.abs(ours - hf_logits(model, tokens)).max()
    assert err < TOLERANCE, err
    # A model MoE only every other layer has no Mixtral form: a one-line error.
    other = _mixtral_config(**{"model.moe.every_n_layers": 2, "model.num_layers": 2})
    run(other, tmp_path / "run2", devices[:1])
    with pytest.raises(ConfigError, match="every_n_layers=2"):
        export_hf(tmp_path / "run2", tmp_path / "out2", devices=devices[:1])


def test_mixtral_mismatches_are_named(tmp_path, devices):
    cfg = _mixtral_config()
    _hf_mixtral(cfg).save_pretrained(tmp_path / "hf")
    wrong = _mixtral_config(**{"model.moe.num_experts": 8, "model.moe.top_k": 1})
    with pytest.raises(ConfigError, match="model.moe.num_experts=8 but config.json "
                                          "num_local_experts=4; model.moe.top_k=1"):
        import_hf(wrong, tmp_path / "hf", tmp_path / "run", devices[:1])
    with pytest.raises(ConfigError, match="has no experts"):
        import_hf(_mixtral_config(), _llama_dir(tmp_path), tmp_path / "run2", devices[:1])


def test_mixtral_sliding_window_maps_both_ways(tmp_path, devices):
    """config.json sliding_window <-> model.sliding_window (null <-> 0). transformers 5 applies
    Mixtral's window in its default attention (sdpa) as in eager: keys (i - W, i]."""
    import transformers

    cfg = _mixtral_config(**{"model.sliding_window": 8})  # seq_len 32
    model = _hf_mixtral(cfg, sliding_window=8)
    model.save_pretrained(tmp_path / "hf")
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    tokens = random_tokens(cfg)
    want = hf_logits(model, tokens)
    err = np.abs(jax_logits(setup, state.params, tokens) - want).max()
    assert err < TOLERANCE, err
    model.config.sliding_window = None  # the same weights, full causal attention
    full = hf_logits(model, tokens)
    assert np.abs(full - want)[:, :8].max() < 1e-5 < 0.01 < np.abs(full - want)[:, 8:].max()
    # Export writes the window; transformers' own loader gives the same logits.
    export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 8
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    err = np.abs(hf_logits(exported, tokens) - want).max()
    assert err < TOLERANCE, err
    # A config that disagrees is named, before any tensor is read.
    with pytest.raises(ConfigError, match="model.sliding_window=0 but config.json "
                                          "sliding_window=8"):
        import_hf(_mixtral_config(), tmp_path / "hf", tmp_path / "run2", devices[:1])
    _hf_mixtral(_mixtral_config()).save_pretrained(tmp_path / "full")
    with pytest.raises(ConfigError, match="model.sliding_window=8 but config.json "
                                          "sliding_window=None"):
        import_hf(cfg, tmp_path / "full", tmp_path / "run3", devices[:1])


def test_a_llama_config_with_a_sliding_window_is_refused(tmp_path, devices):
    """transformers' Llama ignores a sliding_window key (Mistral-style configs carry one): a
    window that would matter within model.seq_len is refused, not silently dropped."""
    directory = _llama_dir(tmp_path)
    hf = json.loads((directory / "config.json").read_text())
    cfg = _config("llama", **{"model.mlp_dim": 96})
    (directory / "config.json").write_text(json.dumps({**hf, "sliding_window": 64}))
    import_hf(cfg, directory, tmp_path / "run", devices[:1])  # 64 >= seq_len 32: the same
    (directory / "config.json").write_text(json.dumps({**hf, "sliding_window": 16}))
    with pytest.raises(ConfigError, match="config.json sliding_window=16 is not supported: "
                                          "LlamaForCausalLM attends to every earlier token"):
        import_hf(cfg, directory, tmp_path / "run2", devices[:1])
    windowed = _config("llama", **{"model.mlp_dim": 96, "model.sliding_window": 16})
    with pytest.raises(ConfigError, match="model.sliding_window=16 but llama attends to every"):
        import_hf(windowed, directory, tmp_path / "run3", devices[:1])


def _llama_dir(tmp_path):
    cfg = _config("llama", **{"model.mlp_dim": 96})
    _hf_model(cfg).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


# ---------------------------------------------------------------------------------------
# A model imported without a tokenizer: ids in and out work, text is not guessed.

def test_an_import_without_a_tokenizer_records_none(tmp_path, devices):
    """A 512-id model from a directory without tokenizer files, into a config on the byte
    corpus: its ids are not bytes, so no tokenizer stands in for the missing one."""
    from jaxtrain.data import record

    cfg = _config("gpt2", **{"model.vocab_size": 512})
    _hf_model(cfg).save_pretrained(tmp_path / "hf")
    import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    assert record.run_tokenizer(tmp_path / "run", cfg) is None
    # Fine-tuning it on the byte corpus makes bytes its tokenizer, as for any run.
    record.check_and_store(tmp_path / "run", *record.run_data(cfg), True, False, True)
    assert record.run_tokenizer(tmp_path / "run", cfg).kind == "bytes"


@pytest.mark.slow
def test_generate_and_eval_of_an_import_without_a_tokenizer(tmp_path, devices):
    cfg = _config("gpt2", **{"model.vocab_size": 512})  # on the byte corpus
    _hf_model(cfg).save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    import_hf(cfg, tmp_path / "hf", run, devices[:1])

    def cli(module, *args):
        return subprocess.run([sys.executable, "-m", f"jaxtrain.commands.{module}", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)

    result = cli("generate", f"--workdir={run}", "--prompt_ids=300,400,511",
                 "--max_new_tokens=4", "--ignore_eos", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["prompt_ids"] == [300, 400, 511] and len(out["generated_ids"]) == 4
    assert out["text"] is None
    result = cli("generate", f"--workdir={run}", "--prompt=def ", "--max_new_tokens=4")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "jaxtrain: error: --prompt needs the model's tokenizer, and this run has none "
        "(data.source='stdlib'); pass --prompt_ids"]
    np.random.default_rng(0).integers(0, 512, 2000).astype(np.uint16).tofile(tmp_path / "t.bin")
    result = cli("eval", f"--workdir={run}", f"--data={tmp_path / 't.bin'}")
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["bits_per_byte"] is None and out["loss"] > 0
    assert "pass --bytes_per_token" in result.stderr
