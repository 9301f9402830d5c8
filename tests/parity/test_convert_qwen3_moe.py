"""Qwen3-MoE (Qwen3MoeForCausalLM, model_type qwen3_moe) against transformers, on CPU: a
tiny random model with decoder_sparse_step 2 (layers 1 and 3 MoE, 0 and 2 dense, each kind
stored apart and mapped by its HF layers), norm_topk_prob false (the k weights as the
softmax gives them), Qwen3's q/k norms, 4 experts, top 2, capacity for every token (so
nothing drops and the function is transformers')."""

import json

import numpy as np
import pytest
from conftest import small_config
from helpers import assert_exports_bitwise, assert_greedy_decode_equals_transformers, jaxtrain_steps
from hf_parity import TWENTY_STEPS, hf_logits, imported, logits_against, random_tokens, randomized

from jaxtrain.errors import ConfigError

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
    return randomized(transformers.Qwen3MoeForCausalLM(config), seed)


def test_import_and_export_give_the_logits_of_transformers(tmp_path, devices):
    """Import within 1e-5; exported, it loads in AutoModelForCausalLM as a
    Qwen3MoeForCausalLM with bitwise the same logits, transformers' own tensors, its MoE
    keys (router_aux_loss_coef = aux_loss_weight / top_k)."""

    cfg = _config()
    model = _hf_model(cfg)
    setup, state = imported(cfg, model, tmp_path, devices[:1])
    assert state.params["blocks"]["mlp"]["w_up"].shape == (2, 64, 128)  # layers 0, 2
    assert state.params["moe_blocks"]["mlp"]["w_up"].shape == (2, 4, 64, 24)  # 1, 3
    tokens = random_tokens(cfg, batch=4)
    want, err = logits_against(model, setup, state.params, tokens)
    assert err < TOLERANCE, err
    assert_exports_bitwise(tmp_path, devices, model, hf_logits, tokens, want)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["decoder_sparse_step"] == 2 and config["norm_topk_prob"] is False
    assert config["router_aux_loss_coef"] == pytest.approx(0.001)
    # The renormalisation shows: the same weights with norm_topk_prob give other logits.
    model.config.norm_topk_prob = True
    for layer in (1, 3):
        model.model.layers[layer].mlp.gate.norm_topk_prob = True
    assert np.abs(hf_logits(model, tokens) - want).max() > 1e-3


def test_what_qwen3_moe_cannot_map_is_refused_in_one_line(tmp_path, devices):
    cfg = _config(**{"model.moe.norm_topk_prob": True})
    model = _hf_model(cfg, mlp_only_layers=[1])
    model.config.norm_topk_prob = False
    with pytest.raises(ConfigError) as e:
        imported(cfg, model, tmp_path, devices[:1])
    message = str(e.value)
    assert "\n" not in message and "mlp_only_layers=[1] is not supported" in message
    assert "model.moe.norm_topk_prob=True but config.json norm_topk_prob=False" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a second compile under a mesh of 8
@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_expert_by_fsdp_by_tensor_gives_the_logits_of_transformers(dispatch, tmp_path, devices):
    """The dense and MoE layers over expert × fsdp × tensor, each dispatch path."""
    from hf_parity import imported_logit_error

    cfg = _config(**{"mesh.expert": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                     "model.moe.dispatch": dispatch})
    err = imported_logit_error(cfg, _hf_model(cfg), tmp_path, devices)
    assert err < TOLERANCE, err


@pytest.mark.slow  # an import and two generation compiles
def test_greedy_generation_equals_transformers(tmp_path, devices):
    """30 greedy tokens through the kv cache, the MoE layers routing one token at a time."""
    cfg = _config(**{"train.global_batch": 1, "model.seq_len": 48})
    model = _hf_model(cfg, seed=2)
    assert_greedy_decode_equals_transformers(*imported(cfg, model, tmp_path, devices[:1]), model)


def _routing_penalty(cfg):
    """jaxtrain's routing losses (models/moe.py routing_losses) written again in PyTorch from
    transformers' router logits ([tokens, experts] per MoE layer): per layer the Switch
    balance (E/k)·Σₑ fₑ·Pₑ and the z-loss mean logsumexp², each averaged over the layers
    and weighted. (transformers' own aux loss pools the layers' tokens before the product,
    so it is another function: a mean of products is not a product of means.)"""
    import torch

    e, k = cfg.model.moe.num_experts, cfg.model.moe.top_k

    def penalty(router_logits):
        aux, z = [], []
        for logits_TE in router_logits:
            prob_TE = torch.softmax(logits_TE, -1)
            chosen = torch.topk(logits_TE, k, -1).indices
            share_E = torch.nn.functional.one_hot(chosen, e).sum((0, 1)) / logits_TE.shape[0]
            aux.append(e / k * (share_E * prob_TE.mean(0)).sum())
            z.append((torch.logsumexp(logits_TE, -1) ** 2).mean())
        return (cfg.model.moe.aux_loss_weight * torch.stack(aux).mean()
                + cfg.model.moe.z_loss_weight * torch.stack(z).mean())
    return penalty


@pytest.mark.slow
def test_twenty_training_steps_equal_pytorch(tmp_path, devices):
    """20 steps in jaxtrain and of transformers' Qwen3MoeForCausalLM in PyTorch, float32,
    the routers' balance and z losses weighted in on both sides (a large weight, so that a
    wrong routing gradient shows): cross entropy and gradient norm of every step within
    1e-5 relative."""
    from test_convert_llama_like import _torch_steps

    cfg = _config(**TWENTY_STEPS, **{"model.moe.aux_loss_weight": 0.5,
                                     "model.moe.z_loss_weight": 0.1})
    model = _hf_model(cfg)
    batches, ours = jaxtrain_steps(cfg, *imported(cfg, model, tmp_path, devices[:1]))
    want = _torch_steps(model, batches, cfg, _routing_penalty(cfg))
    np.testing.assert_allclose(ours, want, rtol=1e-5)
    # The routing losses' gradients show: without them, PyTorch's norms are others.
    plain = _hf_model(cfg)
    assert not np.allclose(_torch_steps(plain, batches[:3], cfg), want[:3], rtol=1e-3)


@pytest.mark.slow
def test_peft_loads_an_adapter_of_the_dense_and_moe_layers(tmp_path, devices):
    """LoRA on the attention of every layer, dense (0, 2) and MoE (1, 3: a stack of their
    own): each adapter lands on its HF layer, and PEFT gives jaxtrain's logits. MLP targets
    are refused in one line: PEFT reads gate/up/down_proj in a Qwen3-MoE adapter as the
    experts' (its conversion of pre-v5 MoE adapters), so a dense layer's would move."""
    from helpers import assert_peft_loads_the_adapter

    from jaxtrain.hf.save import export_hf

    assert_peft_loads_the_adapter(tmp_path, devices, _config, _hf_model, "q,k,v,o",
                                  ["q_proj", "k_proj", "v_proj", "o_proj"])
    from jaxtrain.train.loop import run
    cfg = _config(**{"model.lora.rank": 4, "model.lora.targets": "q,up,down", "steps": 1,
                     "model.lora.base": str(tmp_path / "base")})
    run(cfg, tmp_path / "mlp", devices[:1])
    with pytest.raises(ConfigError) as e:
        export_hf(tmp_path / "mlp", tmp_path / "mlp_adapter", devices=devices[:1], adapter=True)
    assert "\n" not in str(e.value) and "MLP targets down,up of an MoE model" in str(e.value)
    assert not (tmp_path / "mlp_adapter").exists()
