"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text) and Gemma 2 (Gemma2ForCausalLM)
against transformers, on CPU, each family's parts all on: (1 + w) RMSNorm, sandwich norms,
GeGLU, sqrt(d) embedding scale, tied head, an attention scale of query_pre_attn_scalar**-0.5
that is not head_dim's; Gemma 3's q/k norm; Gemma 2's attention-logit soft-cap of 1.0,
which bends the scores. Every layer full attention here; tests/parity/test_layer_types.py has
Gemma 3's sliding layers.
"""

import numpy as np
import pytest
from conftest import small_config
from helpers import assert_exports_bitwise, assert_greedy_decode_equals_transformers, jaxtrain_steps
from hf_parity import TWENTY_STEPS, hf_logits, imported, logits_against, random_tokens, randomized

from jaxtrain.errors import ConfigError
from jaxtrain.hf.load import import_hf

TOLERANCE = 1e-5  # max |Δ logit|, float32


GEMMAS = ["gemma3", "gemma2"]


def _config(family: str = "gemma3", **overrides):
    softcap = 1.0 if family == "gemma2" else 0.0  # Gemma 3's transformers never applies one
    return small_config(family, **{
        "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16,
        "model.attention_scale_dim": 24, "model.norm_eps": 1e-6, "model.rope_theta": 50000.0,
        "model.attn_logit_softcap": softcap, "model.final_logit_softcap": 3.0,
        "model.attention": "xla", **overrides})


def _hf_model(cfg, seed: int = 0, norm_std: float = 1.0, **extra):
    """A Gemma3ForCausalLM of cfg's shape, random weights (norm weights around 0, which
    Gemma applies as 1 + w), every layer full attention; extra: more config keys.
    norm_std: the norm weights' spread (1.0: scales of either sign, some near 0)."""
    import transformers

    m = cfg.model
    gemma3 = m.family == "gemma3"
    theta = {"rope_type": "default", "rope_theta": m.rope_theta}
    rope = {"full_attention": theta, "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}} \
        if gemma3 else theta
    config = (transformers.Gemma3TextConfig if gemma3 else transformers.Gemma2Config)(
        hidden_size=m.d_model, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, intermediate_size=m.mlp_dim,
        vocab_size=m.vocab_size, max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
        query_pre_attn_scalar=m.attention_scale_dim,
        attn_logit_softcapping=m.attn_logit_softcap or None,
        layer_types=["full_attention"] * m.num_layers,
        rope_parameters=rope, final_logit_softcapping=m.final_logit_softcap or None,
        # pad_token_id None: torch's Embedding(padding_idx) would give row 0 no gradient.
        bos_token_id=0, eos_token_id=0, pad_token_id=None, **extra)
    # Eager attention: transformers' sdpa path drops the soft-cap without a word.
    config._attn_implementation = "eager"
    model = (transformers.Gemma3ForCausalLM if gemma3 else transformers.Gemma2ForCausalLM)(
        config)
    # Norm weights of either sign (not moved to 1), a small table: else the tied head reads
    # back the (sqrt(d)-scaled) input embedding and greedy decoding repeats one token.
    return randomized(model, seed, around_one=(), std=lambda name: (
        norm_std if "norm" in name else 0.03 if "embed" in name else 0.1))


@pytest.mark.parametrize("family", GEMMAS)
def test_import_and_export_give_the_logits_of_transformers(family, tmp_path, devices):
    """Import: logits within 1e-5; exported, it loads in AutoModelForCausalLM as a
    Gemma3ForCausalLM with the same logits and transformers' own tensors."""

    cfg = _config(family)
    model = _hf_model(cfg)
    setup, state = imported(cfg, model, tmp_path, devices[:1])
    assert "lm_head" not in state.params  # tied
    tokens = random_tokens(cfg, batch=4)
    want, err = logits_against(model, setup, state.params, tokens)
    assert err < TOLERANCE, err
    assert_exports_bitwise(tmp_path, devices, model, hf_logits, tokens, want,
                           attn_implementation="eager")
    # Sharded over fsdp × tensor: the same logits.
    sharded = _config(family, **{"mesh.fsdp": 2, "mesh.tensor": 2})
    setup, state = import_hf(sharded, tmp_path / "hf", tmp_path / "mesh", devices[:4])
    _, err = logits_against(model, setup, state.params, tokens)
    assert err < TOLERANCE, err


@pytest.mark.parametrize("family", GEMMAS)
def test_greedy_generation_equals_transformers(family, tmp_path, devices):
    cfg = _config(family, **{"train.global_batch": 1, "model.seq_len": 48})
    model = _hf_model(cfg, seed=2)
    assert_greedy_decode_equals_transformers(*imported(cfg, model, tmp_path, devices[:1]), model)


def test_gemma3_layer_types_unlike_the_config_and_soft_caps_are_refused_in_one_line(
        tmp_path, devices):
    cfg = _config()
    model = _hf_model(cfg)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    model.config.attn_logit_softcapping = 30.0  # a key transformers' Gemma 3 never applies
    with pytest.raises(ConfigError) as e:
        imported(cfg, model, tmp_path, devices[:1])
    message = str(e.value)
    assert "\n" not in message and "layer_types" in message and "attn_logit_softcapping" \
        in message
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", GEMMAS)
def test_twenty_training_steps_equal_pytorch(family, tmp_path, devices):
    """20 steps in jaxtrain and in PyTorch, float32: loss and gradient norm of every step
    within 1e-5 relative (test_convert_llama_like.py's loop; Gemma's norm weights, named
    *norm.weight, are not decayed on either side)."""
    from test_convert_llama_like import _torch_steps

    cfg = _config(family, **TWENTY_STEPS)
    # Norm scales near 1: scales near 0 (norm_std 1) let Adam amplify float noise.
    model = _hf_model(cfg, norm_std=0.1)
    batches, ours = jaxtrain_steps(cfg, *imported(cfg, model, tmp_path, devices[:1]))
    np.testing.assert_allclose(ours, _torch_steps(model, batches, cfg), rtol=1e-5)


def test_kernels_without_the_soft_cap_part_refuse_it_in_one_line():
    """Each kernel but xla (cuDNN, Pallas and splash included, on their own platforms and
    precisions) names the part and itself; validation fails before anything compiles."""
    from jaxtrain.config import validate
    from jaxtrain.models.attention import KERNELS, resolve_attention

    for kernel in KERNELS.values():
        platform = kernel.platforms[0]
        precision = "float32" if kernel.float32 else "bfloat16"
        problem = kernel.problem(precision, platform, 256, 0, False, 1.0)
        if kernel.softcap:
            assert problem is None, kernel.name
        else:
            assert f"the {kernel.name} kernel cannot run the attention-logit soft-cap" \
                in problem and "\n" not in problem
    assert resolve_attention("auto", "bfloat16", "gpu", 256, 0, False, 1.0) == "xla"
    with pytest.raises(ConfigError, match=r"model.attention='chunked' is invalid: the "
                       r"chunked kernel cannot run the attention-logit soft-cap part"):
        validate(_config("gemma2", **{"model.attention": "chunked"}), 1, "cpu")
    with pytest.raises(ConfigError, match=r"model.attn_logit_softcap=1.0 is invalid: the "
                       "context-parallel"):
        validate(_config("gemma2", **{"mesh.context": 2}), 2, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("family", GEMMAS)
def test_peft_loads_the_adapter_with_the_same_logits(family, tmp_path, devices):
    """LoRA on every projection of an imported Gemma 3 or 2 (sandwich norms, q/k norms or
    Gemma 2's soft-caps, GeGLU, the embedding scale and tied head around them): PEFT gives
    jaxtrain's logits."""
    from helpers import assert_peft_loads_the_adapter

    assert_peft_loads_the_adapter(
        tmp_path, devices, lambda **o: _config(family, **o), _hf_model,
        "q,k,v,o,gate,up,down",
        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"],
        attn_implementation="eager")
