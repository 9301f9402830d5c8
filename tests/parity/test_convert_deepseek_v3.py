"""DeepSeek-V3 (DeepseekV3ForCausalLM, model_type deepseek_v3) and Mistral 4
(Mistral4ForCausalLM, the same parts with a softmax router and no correction bias) against
transformers, on CPU: a tiny random model with every part on: multi-head latent attention
with q_lora_rank set (models/mla.py), the first layer dense and the other two MoE, 8 routed
experts in 2 groups (topk_group 1) plus a shared expert, the router (DeepSeek's sigmoid with
a nonzero correction bias; Mistral 4's softmax), norm_topk_prob and routed_scaling_factor
2.5 (models/router.py). Capacity for every token, so nothing drops and the function is
transformers'."""

import json

import jax
import numpy as np
import pytest
from conftest import small_config
from helpers import (
    assert_exports_bitwise,
    assert_greedy_decode_equals_transformers,
    first_batches,
    jaxtrain_steps,
    stepping,
)
from hf_parity import TWENTY_STEPS, hf_logits, imported, logits_against, random_tokens, randomized

from jaxtrain.data.batches import make_batches, to_global
from jaxtrain.errors import ConfigError
from jaxtrain.train.setup import build

TOLERANCE = 1e-5  # max |Δ logit|, float32
E, K = 8, 2


ROUTERS = {"deepseek_v3": "sigmoid_bias", "mistral4": "softmax_group"}


# Mistral 4 under YaRN (transformers' Mistral4 rotates right only under YaRN): factor 4 over
# 8 original positions, mscale_all_dim 1 (the softmax scale, deepseek_v3.check_rope).
YARN = {"model.rope_scaling.type": "yarn", "model.rope_scaling.factor": 4.0,
        "model.rope_scaling.original_max_position_embeddings": 8,
        "model.rope_scaling.attention_factor": 1.0,
        "model.mla.softmax_scale": 12 ** -0.5 * (0.1 * np.log(4.0) + 1) ** 2}


def _config(arch: str = "deepseek_v3", **overrides):
    if arch == "mistral4":
        overrides = {**YARN, **overrides}
    return small_config(arch, **{
        "model.num_layers": 3, "model.num_heads": 4, "model.norm_eps": 1e-6,
        "model.mlp_dim": 96, "model.attention": "chunked",
        "model.mla.kv_lora_rank": 16, "model.mla.q_lora_rank": 12,
        "model.mla.qk_nope_head_dim": 8, "model.mla.qk_rope_head_dim": 4,
        "model.mla.v_head_dim": 6,
        "model.moe.num_experts": E, "model.moe.top_k": K, "model.moe.expert_mlp_dim": 24,
        "model.moe.shared_experts": 1, "model.moe.first_dense_layers": 1,
        "model.moe.router": ROUTERS[arch], "model.moe.n_group": 2, "model.moe.topk_group": 1,
        "model.moe.routed_scaling_factor": 2.5, "model.moe.dispatch": "capacity",
        "model.moe.capacity_factor": E / K, "model.moe.aux_loss_weight": 0.0,
        "model.moe.z_loss_weight": 0.0, "model.moe.bias_update_rate": 0.0, **overrides})


def _hf_config(cfg, **extra):
    import transformers

    m = cfg.model
    if m.family == "mistral4":  # llama_4_scaling_beta 0: no query scale past 8 positions
        extra = {"rope_parameters": {"rope_type": "yarn", "rope_theta": m.rope_theta,
                                     "factor": 4.0, "original_max_position_embeddings": 8,
                                     "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "llama_4_scaling_beta": 0.0},
                 # (its default pad_token_id 11 would be nn.Embedding's padding_idx, whose
                 # row takes no gradient in PyTorch; jaxtrain's embedding has none)
                 "pad_token_id": None, **extra}
    else:
        extra = {"rope_theta": m.rope_theta, **extra}
    config_class = {"deepseek_v3": transformers.DeepseekV3Config,
                    "mistral4": transformers.Mistral4Config}[m.family]
    return config_class(
        hidden_size=m.d_model, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_heads, intermediate_size=m.mlp_dim,
        moe_intermediate_size=m.moe.expert_mlp_dim, n_routed_experts=m.moe.num_experts,
        num_experts_per_tok=m.moe.top_k, n_shared_experts=m.moe.shared_experts,
        first_k_dense_replace=m.moe.first_dense_layers, n_group=m.moe.n_group,
        topk_group=m.moe.topk_group, norm_topk_prob=m.moe.norm_topk_prob,
        routed_scaling_factor=m.moe.routed_scaling_factor, kv_lora_rank=m.mla.kv_lora_rank,
        q_lora_rank=m.mla.q_lora_rank or None, qk_nope_head_dim=m.mla.qk_nope_head_dim,
        qk_rope_head_dim=m.mla.qk_rope_head_dim, v_head_dim=m.mla.v_head_dim,
        vocab_size=m.vocab_size, max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager", **extra)


def _hf_model(cfg, seed: int = 0, **extra):
    import torch
    import transformers

    model_class = {"deepseek_v3": transformers.DeepseekV3ForCausalLM,
                   "mistral4": transformers.Mistral4ForCausalLM}[cfg.model.family]
    model = randomized(model_class(_hf_config(cfg, **extra)), seed)
    with torch.no_grad():  # the same seeded draws go on
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change choices
                b.normal_(0.0, 0.05)
    return model


def _imported(cfg, tmp_path, devices, seed: int = 0):
    model = _hf_model(cfg, seed)
    return (model, *imported(cfg, model, tmp_path, devices))


@pytest.mark.parametrize("arch", ROUTERS)
def test_import_and_export_give_the_logits_of_transformers(arch, tmp_path, devices):
    """Import within 1e-5 (latent attention, dense prefix, shared and routed experts, the
    router; DeepSeek's correction bias); exported, it loads in AutoModelForCausalLM as the
    same class with bitwise the same logits and tensors."""
    cfg = _config(arch)
    model, setup, state = _imported(cfg, tmp_path, devices[:1])
    mlp = state.params["moe_blocks"]["mlp"]
    assert mlp["w_up"].shape == (2, E, 64, 24) and mlp["shared"]["w_up"].shape == (2, 64, 24)
    assert state.params["blocks"]["mlp"]["w_up"].shape == (1, 64, 96)
    assert state.params["blocks"]["attn"]["w_k_up"].shape == (1, 16, 4, 8)
    tokens = random_tokens(cfg, batch=4)
    want, err = logits_against(model, setup, state.params, tokens)
    assert err < TOLERANCE, err
    assert_exports_bitwise(tmp_path, devices, model, hf_logits, tokens, want,
                           attn_implementation="eager")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["first_k_dense_replace"] == 1 and config["n_group"] == 2
    if arch == "mistral4":
        assert "e_score_correction_bias" not in mlp
        return
    bias = model.model.layers[2].mlp.gate.e_score_correction_bias.numpy()
    np.testing.assert_array_equal(mlp["e_score_correction_bias"][1], bias)
    # The correction bias shows: without it transformers picks other experts.
    for layer in (1, 2):
        model.model.layers[layer].mlp.gate.e_score_correction_bias.zero_()
    assert np.abs(hf_logits(model, tokens) - want).max() > 1e-3


def test_what_deepseek_v3_cannot_map_is_refused_in_one_line(tmp_path, devices):
    cfg = _config(**{"model.moe.first_dense_layers": 2, "model.mla.v_head_dim": 8,
                     "model.mtp.depths": 1})
    model = _hf_model(_config(), topk_method="greedy")
    with pytest.raises(ConfigError) as e:
        imported(cfg, model, tmp_path, devices[:1])
    message = str(e.value)
    assert "\n" not in message
    assert "model.moe.first_dense_layers=2 but config.json first_k_dense_replace=1" in message
    assert "model.mla.v_head_dim=8 but config.json v_head_dim=6" in message
    assert "topk_method='greedy' is not supported" in message
    assert "model.mtp.depths=1 but the import does not read" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # an import and two generation compiles
@pytest.mark.parametrize("arch", ROUTERS)
def test_greedy_generation_through_the_latent_cache_equals_transformers(arch, tmp_path,
                                                                         devices):
    """30 greedy tokens: jaxtrain decodes from the latent cache with the up-projections
    absorbed (models/mla.py), transformers from its own latent cache."""
    cfg = _config(arch, **{"train.global_batch": 1, "model.seq_len": 48})
    model, setup, state = _imported(cfg, tmp_path, devices[:1], seed=2)
    assert_greedy_decode_equals_transformers(setup, state, model)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ROUTERS)
def test_twenty_training_steps_equal_pytorch(arch, tmp_path, devices):
    """20 steps in jaxtrain and of transformers' model in PyTorch, float32, with the bias
    frozen (γ = 0: transformers has no update rule; the next test checks the rule): cross
    entropy and gradient norm of every step within 1e-5 relative."""
    from test_convert_llama_like import _torch_steps

    cfg = _config(arch, **TWENTY_STEPS)
    model, setup, state = _imported(cfg, tmp_path, devices[:1])
    batches, ours = jaxtrain_steps(cfg, setup, state)
    np.testing.assert_allclose(ours, _torch_steps(model, batches, cfg), rtol=1e-5)


def _numpy_loads(model, tokens_BT) -> np.ndarray:
    """Each MoE layer's expert loads [layers, E] of transformers' routers on a batch's inputs
    (the routers' choices, read by a hook on each gate)."""
    import torch

    loads = []

    def hook(module, args, out):  # (router logits, weights, indices)
        indices = out[2]
        loads.append(np.bincount(indices.reshape(-1).numpy(), minlength=E))

    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    with torch.no_grad():
        model(torch.from_numpy(tokens_BT[:, :-1].astype(np.int64)))
    for h in handles:
        h.remove()
    return np.stack(loads).astype(np.float64)


def _numpy_rule(bias_NE, load_NE, gamma):
    """DeepSeek-V3 report §2.1.2 in float64: b_i -= γ if expert i is overloaded (its load
    above its layer's mean), += γ if underloaded."""
    mean = load_NE.mean(-1, keepdims=True)
    return bias_NE + gamma * ((load_NE < mean).astype(np.float64)
                              - (load_NE > mean).astype(np.float64))


def test_the_train_step_moves_the_correction_bias_by_the_report_rule(tmp_path, devices):
    """One train step with γ = 0.01: each MoE layer's bias moves as the float64 rule says on
    the loads transformers' routers give for that batch; the bias takes no gradient (the
    logged grad_norm is the weights' alone), and nothing else about the step changes."""
    gamma = 0.01
    cfg = _config(**{"model.moe.bias_update_rate": gamma, "data.source": "synthetic",
                     "train.global_batch": 4})
    model, setup, state = _imported(cfg, tmp_path, devices[:1])
    before = np.asarray(state.params["moe_blocks"]["mlp"]["e_score_correction_bias"],
                        np.float64)
    tokens = np.asarray(next(make_batches(cfg).train_iter(0)))
    want = _numpy_rule(before, _numpy_loads(model, tokens), gamma)
    with jax.set_mesh(setup.mesh):
        new, metrics = setup.train_step()(state, to_global(tokens, setup.tokens_sharding))
    got = np.asarray(new.params["moe_blocks"]["mlp"]["e_score_correction_bias"])
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert np.abs(got - before).max() == pytest.approx(gamma)
    assert "moe_expert_load" not in metrics and np.isfinite(float(metrics["grad_norm"]))


def _steps(cfg, devices):
    """([(loss, grad_norm)] of three steps, the final params as numpy)."""
    setup = build(cfg, devices)
    after = list(stepping(setup, setup.init_state(), first_batches(cfg, 3)))
    out = [(float(m["loss"]), float(m["grad_norm"])) for _, m in after]
    return out, jax.tree.map(np.asarray, after[-1][0].params)


@pytest.mark.slow  # three compiles under meshes of 2, 4 and 1
@pytest.mark.parametrize("mesh", [{"mesh.expert": 2}, {"mesh.fsdp": 2, "mesh.tensor": 2}],
                         ids=["expert2", "fsdp2_tensor2"])
def test_parallel_training_equals_one_device(mesh, devices):
    """Three steps with the bias moving (γ = 0.01) and the routing losses on: loss,
    grad_norm, every parameter and the correction bias equal one device's (the loads are global sums, so
    every replica moves the bias alike)."""
    from helpers import assert_params_close

    overrides = {"model.moe.bias_update_rate": 0.01, "model.moe.aux_loss_weight": 0.01,
                 "model.moe.z_loss_weight": 0.001}
    one_losses, one = _steps(_config(**overrides), devices[:1])
    size = int(np.prod(list(mesh.values())))
    many_losses, many = _steps(_config(**overrides, **mesh), devices[:size])
    np.testing.assert_allclose(many_losses, one_losses, rtol=2e-5)
    assert_params_close(many, one, rtol=2e-4)
    bias = "moe_blocks", "mlp", "e_score_correction_bias"
    np.testing.assert_array_equal(many[bias[0]][bias[1]][bias[2]], one[bias[0]][bias[1]][bias[2]])
