"""gpt-oss (GptOssForCausalLM, model_type gpt_oss) against transformers' eager attention, on
CPU: a tiny random model with both layer kinds (sliding, full, sliding, full; a window of 8
under 32 positions), attention sinks, q/k/v/o biases, YaRN RoPE (truncate false), 4 experts,
top 2, with the router's bias and the experts' biases and clamped SwiGLU (weights large
enough that the clamp bites), capacity for every token (nothing drops: transformers'
function)."""

import json

import numpy as np
import pytest
from conftest import small_config
from helpers import assert_exports_bitwise, assert_greedy_decode_equals_transformers, jaxtrain_steps
from hf_parity import TWENTY_STEPS, hf_logits, imported, logits_against, random_tokens, randomized

from jaxtrain.errors import ConfigError

TOLERANCE = 1e-5  # max |Δ logit|, float32
# Spread of each random HF tensor (by a piece of its name): the experts' gate_up wide, so
# that the clamp at 7 takes some of their outputs; sinks and router bias wide enough to
# matter; the rest small.
STDS = {"gate_up_proj": 0.5, "sinks": 1.0, "router.bias": 1.0, "embed": 0.3}


def _config(**overrides):
    return small_config("gpt_oss", **{
        "model.num_layers": 4, "model.num_heads": 4, "model.num_kv_heads": 2,
        "model.head_dim": 16, "model.mlp_dim": 32, "model.norm_eps": 1e-5,
        "model.attention": "xla", "model.rope_theta": 150000.0,
        "model.layer_types": "sliding,full", "model.sliding_window": 8,
        "model.rope_scaling.type": "yarn", "model.rope_scaling.factor": 4.0,
        "model.rope_scaling.original_max_position_embeddings": 16,
        "model.rope_scaling.truncate": False,
        "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_mlp_dim": 32,
        "model.moe.dispatch": "capacity", "model.moe.capacity_factor": 2.0,
        "model.moe.aux_loss_weight": 0.002, **overrides})


def _hf_model(cfg, seed: int = 0, **extra):
    import transformers

    m = cfg.model
    s = m.rope_scaling
    kinds = [k.strip() for k in m.layer_types.split(",")]
    config = transformers.GptOssConfig(
        hidden_size=m.d_model, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
        intermediate_size=m.moe.expert_mlp_dim, num_local_experts=m.moe.num_experts,
        num_experts_per_tok=m.moe.top_k, vocab_size=m.vocab_size,
        max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
        sliding_window=m.sliding_window,
        layer_types=[f"{kinds[i % len(kinds)]}_attention" for i in range(m.num_layers)],
        rope_parameters={"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": s.factor,
                         "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
                         "truncate": s.truncate,
                         "original_max_position_embeddings": s.original_max_position_embeddings},
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None, **extra)
    config._attn_implementation = "eager"
    return randomized(transformers.GptOssForCausalLM(config), seed,
                      std=lambda name: next((v for k, v in STDS.items() if k in name), 0.1))


def test_import_and_export_give_the_logits_of_transformers(tmp_path, devices):
    """Import within 1e-5; exported, it loads in
    AutoModelForCausalLM as a GptOssForCausalLM with bitwise the same logits, transformers'
    own tensors and its keys."""

    cfg = _config()
    model = _hf_model(cfg)
    setup, state = imported(cfg, model, tmp_path, devices[:1])
    assert "blocks" not in state.params  # every layer MoE
    mlp = state.params["moe_blocks"]["mlp"]
    assert mlp["w_gate"].shape == (4, 4, 64, 32) and mlp["b_up"].shape == (4, 4, 32)
    tokens = random_tokens(cfg, batch=4)
    want, err = logits_against(model, setup, state.params, tokens)
    assert err < TOLERANCE, err
    assert_exports_bitwise(tmp_path, devices, model, hf_logits, tokens, want,
                           attn_implementation="eager")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["sliding_window"] == 8 and config["rope_parameters"]["truncate"] is False
    assert config["router_aux_loss_coef"] == pytest.approx(0.001)
    # The parts show: without the clamp, the router bias or the sinks, other logits.
    for layer in model.model.layers:
        layer.mlp.experts.limit = 1e9
    assert np.abs(hf_logits(model, tokens) - want).max() > 1e-3


@pytest.mark.slow  # a second compile under a mesh of 8
@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_sharded_import_gives_the_same_logits(dispatch, tmp_path, devices):
    """Over expert × fsdp × tensor (the experts' biases split with their experts and hidden
    dimension, the down bias added after the tensor-parallel sum), each dispatch path."""
    from hf_parity import imported_logit_error

    cfg = _config(**{"mesh.expert": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                     "model.moe.dispatch": dispatch})
    err = imported_logit_error(cfg, _hf_model(cfg), tmp_path, devices)
    assert err < TOLERANCE, err


@pytest.mark.slow  # a second import and two generation compiles
def test_greedy_generation_equals_transformers(tmp_path, devices):
    """30 greedy tokens through the kv cache past the window (35 positions, window 8)."""
    cfg = _config(**{"train.global_batch": 1, "model.seq_len": 48})
    model = _hf_model(cfg, seed=2)
    assert_greedy_decode_equals_transformers(*imported(cfg, model, tmp_path, devices[:1]), model)


def test_what_gpt_oss_cannot_map_is_refused_in_one_line(tmp_path, devices):
    cfg = _config()
    model = _hf_model(cfg, swiglu_limit=5.0)
    model.config.quantization_config = {"quant_method": "mxfp4"}
    model.config.layer_types = ["full_attention"] * 4
    with pytest.raises(ConfigError) as e:
        imported(cfg, model, tmp_path, devices[:1])
    message = str(e.value)
    assert "\n" not in message
    assert "config.json swiglu_limit=5.0" in message
    assert "quantization_config='mxfp4' is not supported" in message
    assert "config.json layer_types/sliding_window give F,F,F,F" in message
    assert not (tmp_path / "run").exists()


def test_the_family_is_every_layer_moe():
    from jaxtrain.config import validate

    for key, value in (("model.moe.num_experts", 0), ("model.moe.every_n_layers", 2)):
        with pytest.raises(ConfigError, match=f"{key}={value} is invalid: .*every layer is MoE"):
            validate(_config(**{key: value, "model.layer_types": ""}), 8)


@pytest.mark.slow
def test_twenty_training_steps_equal_pytorch(tmp_path, devices):
    """20 steps in jaxtrain and of transformers' GptOssForCausalLM (eager attention with its
    sinks) in PyTorch, float32, the routers' balance and z losses weighted in on both sides
    (test_convert_qwen3_moe.py's PyTorch penalty, on logits with the router's bias): cross
    entropy and gradient norm of every step within 1e-5 relative. Decay as jaxtrain's: the
    fused experts' weights and the router's weight, not their biases or the sinks."""
    from test_convert_llama_like import _torch_steps
    from test_convert_qwen3_moe import _routing_penalty

    cfg = _config(**TWENTY_STEPS, **{"model.moe.aux_loss_weight": 0.5,
                                     "model.moe.z_loss_weight": 0.01})
    model = _hf_model(cfg)
    batches, ours = jaxtrain_steps(cfg, *imported(cfg, model, tmp_path, devices[:1]))
    np.testing.assert_allclose(ours, _torch_steps(model, batches, cfg, _routing_penalty(cfg)),
                               rtol=1e-5)


@pytest.mark.slow
def test_peft_loads_an_attention_adapter_with_the_same_logits(tmp_path, devices):
    """LoRA on q, k, v and o of every layer, both kinds (the experts have no PEFT module):
    PEFT on transformers' eager gpt-oss gives jaxtrain's logits, within 2e-5 (13 of 32768
    logits were 1.1-1.8e-5 off at 1e-5: this tiny model's wide expert weights, STDS, give
    logits up to ±3 and more float32 rounding than the other families' 0.1-wide ones)."""
    from helpers import assert_peft_loads_the_adapter

    assert_peft_loads_the_adapter(tmp_path, devices, _config, _hf_model, "q,k,v,o",
                                  ["q_proj", "k_proj", "v_proj", "o_proj"], atol=2e-5,
                                  attn_implementation="eager")
