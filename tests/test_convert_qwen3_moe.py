"""Qwen3-MoE (Qwen3MoeForCausalLM, model_type qwen3_moe) against transformers, on CPU: a
tiny random model with decoder_sparse_step 2 (layers 1 and 3 MoE, 0 and 2 dense, each kind
stored apart and mapped by its HF layers), norm_topk_prob false (the k weights as the
softmax gives them), Qwen3's q/k norms, 4 experts, top 2, capacity for every token (so
nothing drops and the function is transformers')."""

import json

import numpy as np
import pytest
from conftest import small_config
from helpers import assert_exports_bitwise
from test_convert import _hf_logits, _jax_logits, _tokens

from jaxtrain.errors import ConfigError
from jaxtrain.hf.load import import_hf

TOLERANCE = 1e-5  # max |Δ logit|, float32


def _config(**overrides):
    return small_config("qwen3", **{
        "model.num_layers": 4, "model.num_heads": 4, "model.num_kv_heads": 2,
        "model.head_dim": 16, "model.norm_eps": 1e-6, "model.attention": "xla",
        "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_mlp_dim": 24,
        "model.moe.every_n_layers": 2, "model.moe.norm_topk_prob": False,
        "model.moe.dispatch": "capacity", "model.moe.capacity_factor": 2.0,
        "model.moe.aux_loss_weight": 0.002, **overrides})


def _hf_model(cfg, seed: int = 0, **extra):
    import torch
    import transformers

    m = cfg.model
    config = transformers.Qwen3MoeConfig(
        hidden_size=m.d_model, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, intermediate_size=m.mlp_dim,
        moe_intermediate_size=m.moe.expert_mlp_dim, num_experts=m.moe.num_experts,
        num_experts_per_tok=m.moe.top_k, decoder_sparse_step=m.moe.every_n_layers,
        norm_topk_prob=m.moe.norm_topk_prob, vocab_size=m.vocab_size,
        max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, **extra)
    model = transformers.Qwen3MoeForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    return model.float().eval()


def test_import_and_export_give_the_logits_of_transformers(tmp_path, devices):
    """Import within 1e-5; exported, it loads in AutoModelForCausalLM as a
    Qwen3MoeForCausalLM with bitwise the same logits, transformers' own tensors, its MoE
    keys (router_aux_loss_coef = aux_loss_weight / top_k)."""

    cfg = _config()
    model = _hf_model(cfg)
    model.save_pretrained(tmp_path / "hf")
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    assert state.params["blocks"]["mlp"]["w_up"].shape == (2, 64, 128)  # layers 0, 2
    assert state.params["moe_blocks"]["mlp"]["w_up"].shape == (2, 4, 64, 24)  # 1, 3
    tokens = _tokens(cfg, batch=4)
    want = _hf_logits(model, tokens)
    err = np.abs(_jax_logits(setup, state.params, tokens) - want).max()
    assert err < TOLERANCE, err
    assert_exports_bitwise(tmp_path, devices, model, _hf_logits, tokens, want)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["decoder_sparse_step"] == 2 and config["norm_topk_prob"] is False
    assert config["router_aux_loss_coef"] == pytest.approx(0.001)
    # The renormalisation shows: the same weights with norm_topk_prob give other logits.
    model.config.norm_topk_prob = True
    for layer in (1, 3):
        model.model.layers[layer].mlp.gate.norm_topk_prob = True
    assert np.abs(_hf_logits(model, tokens) - want).max() > 1e-3


def test_what_qwen3_moe_cannot_map_is_refused_in_one_line(tmp_path, devices):
    cfg = _config(**{"model.moe.norm_topk_prob": True})
    model = _hf_model(cfg, mlp_only_layers=[1])
    model.config.norm_topk_prob = False
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError) as e:
        import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    message = str(e.value)
    assert "\n" not in message and "mlp_only_layers=[1] is not supported" in message
    assert "model.moe.norm_topk_prob=True but config.json norm_topk_prob=False" in message
    assert not (tmp_path / "run").exists()
