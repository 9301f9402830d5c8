"""Families made of parts (models/families.py) against transformers' own models, on CPU:
Qwen2.5 (q/k/v biases), Qwen3 dense (per-head q/k RMSNorm) and Mistral (a sliding window
shorter than the sequence), through jaxtrain/hf/llama_like.py. Each tiny random config has
its family's parts switched on; tests/parity/test_convert.py holds GPT-2, Llama and Mixtral's.
"""

import numpy as np
import pytest
from conftest import small_config
from helpers import (
    assert_exports_bitwise,
    assert_greedy_decode_equals_transformers,
    assert_peft_loads_the_adapter,
    jaxtrain_steps,
)
from hf_parity import (
    TWENTY_STEPS,
    decay_groups,
    hf_logits,
    imported,
    jax_logits,
    logits_against,
    next_token_loss,
    random_tokens,
    randomized,
    torch_steps,
)

from jaxtrain.hf.load import import_hf

TOLERANCE = 1e-5  # max |Δ logit|, float32
FAMILIES = ["qwen2", "qwen3", "mistral"]
WINDOW = 8  # Mistral's: shorter than the sequences below, so the window shows


def _config(family: str, **overrides):
    extra = {"model.sliding_window": WINDOW} if family == "mistral" else {}
    return small_config(family, **{
        "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16,
        "model.norm_eps": 1e-6, "model.attention": "xla", **extra, **overrides})


def _hf_model(cfg, seed: int = 0):
    """A transformers model of cfg's shape, random weights (norms around 1, biases non-zero,
    so that a misplaced or dropped tensor shows)."""
    import transformers

    m = cfg.model
    kind = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[m.family]
    extra = {"sliding_window": m.sliding_window or None} if m.family == "mistral" else {}
    config = getattr(transformers, f"{kind}Config")(
        hidden_size=m.d_model, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, intermediate_size=m.mlp_dim,
        vocab_size=m.vocab_size, max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        **extra)
    return randomized(getattr(transformers, f"{kind}ForCausalLM")(config), seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_and_export_give_the_logits_of_transformers(family, tmp_path, devices):
    """Import: logits within 1e-5; the import exported (`convert --to-hf`) loads in
    AutoModelForCausalLM with the same logits, its tensors transformers' own, bit for bit."""

    cfg = _config(family)
    model = _hf_model(cfg)
    setup, state = imported(cfg, model, tmp_path, devices[:1])
    tokens = random_tokens(cfg, batch=4)
    want, err = logits_against(model, setup, state.params, tokens)
    assert err < TOLERANCE, err
    assert_exports_bitwise(tmp_path, devices, model, hf_logits, tokens, want)


@pytest.mark.slow  # two more imports' compiles; test_convert_gemma.py's fsdp × tensor is fast
def test_fsdp_by_tensor_gives_the_logits_of_one_device(tmp_path, devices):
    """Qwen3's q/k norms, Qwen2's biases and Mistral's window sharded over fsdp×tensor:
    the same logits."""
    for family in FAMILIES:
        cfg = _config(family)
        model = _hf_model(cfg)
        model.save_pretrained(tmp_path / family)
        sharded = _config(family, **{"mesh.fsdp": 2, "mesh.tensor": 2})
        setup, state = import_hf(sharded, tmp_path / family, tmp_path / f"{family}-run",
                                 devices[:4])
        tokens = random_tokens(cfg, batch=4)
        err = np.abs(jax_logits(setup, state.params, tokens) - hf_logits(model, tokens)).max()
        assert err < TOLERANCE, (family, err)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers(family, tmp_path, devices):
    """30 greedy tokens through the kv cache; Mistral's window (8) is shorter than the 35
    positions, so its cached decode masks by the window too."""
    cfg = _config(family, **{"train.global_batch": 1, "model.seq_len": 48})
    model = _hf_model(cfg, seed=2)
    assert_greedy_decode_equals_transformers(*imported(cfg, model, tmp_path, devices[:1]), model)


def _decays(name: str) -> bool:
    """jaxtrain's decay mask (optim.decay_mask: matmul weights and the head) in transformers'
    names: the projections (DeepSeek's kv_a_proj_with_mqa, Gated DeltaNet's in_proj_* too),
    the head, a router's weight and fused experts' weights; never norms, biases, sinks, a
    router's correction bias, nor Gated DeltaNet's conv, A_log and dt_bias."""
    return (name.endswith(("proj.weight", "gate.weight", "router.weight", "experts.gate_up_proj",
                           "experts.down_proj", "kv_a_proj_with_mqa.weight",
                           "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight",
                           "in_proj_b.weight"))
            or name == "lm_head.weight")


def _torch_steps(model, batches, cfg, penalty=None):
    """(loss, gradient norm) of each step of a plain PyTorch loop (hf_parity.torch_steps):
    mean cross entropy over every target (plus `penalty(router logits of each MoE layer)`
    where given, which is differentiated but not logged, as jaxtrain's routing losses);
    AdamW decaying where jaxtrain decays (`_decays`)."""

    def loss_of(model, tokens):
        if penalty is None:
            return (next_token_loss(model, tokens)[1],) * 2
        forward, loss = next_token_loss(model, tokens, output_router_logits=True)
        return loss, loss + penalty(forward.router_logits)

    return torch_steps(model, batches, cfg, decay_groups(model, _decays, cfg.optimizer.weight_decay),
                       loss_of)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_twenty_training_steps_equal_pytorch(family, tmp_path, devices):
    """20 steps of the imported model in jaxtrain and of transformers' in PyTorch, float32:
    loss and gradient norm of every step within 1e-5 relative (as test_sft.py's Llama)."""
    cfg = _config(family, **TWENTY_STEPS)
    model = _hf_model(cfg)
    batches, ours = jaxtrain_steps(cfg, *imported(cfg, model, tmp_path, devices[:1]))
    np.testing.assert_allclose(ours, _torch_steps(model, batches, cfg), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_the_adapter_with_the_same_logits(family, tmp_path, devices):
    """LoRA on every projection of an imported model (Qwen2's biased q/k/v, Qwen3's q/k
    norms, Mistral's window): the exported adapter's target modules are PEFT's names for
    it, and PEFT on the transformers base gives jaxtrain's logits."""
    assert_peft_loads_the_adapter(
        tmp_path, devices, lambda **o: _config(family, **o), _hf_model,
        "q,k,v,o,gate,up,down",
        ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"])
