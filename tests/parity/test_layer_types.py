"""Per-layer kinds (model.layer_types: sliding or full attention, each with its rope) against
transformers' `layer_types`, on CPU: Qwen3 (its sliding layers rotate as the full ones) and
Gemma 3 text (its sliding layers by their own theta), each a tiny random model of three
layers, sliding, full, sliding (a repeated two-kind list), with a window of 8 shorter than
the sequence: import within 1e-5, export loads in AutoModelForCausalLM with the same logits
and layer_types, greedy decoding through the kv cache equal. The refusals (one line each)
and the planner's attention FLOPs, counted against the masks themselves.
"""

import numpy as np
import pytest
from conftest import small_config
from hf_parity import hf_logits, jax_logits, random_tokens

from jaxtrain.errors import ConfigError
from jaxtrain.hf.load import import_hf
from jaxtrain.hf.save import export_hf

TOLERANCE = 1e-5  # max |Δ logit|, float32
WINDOW = 8
PATTERN = "sliding,full"  # over 3 layers: sliding, full, sliding
HF_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _config(family: str, **overrides):
    gemma = family == "gemma3"
    extra = {"model.attention_scale_dim": 24, "model.rope_local_theta": 10000.0,
             "model.final_logit_softcap": 3.0} if gemma else {}
    return small_config(family, **{
        "model.num_layers": 3, "model.num_heads": 4, "model.num_kv_heads": 2,
        "model.head_dim": 16, "model.norm_eps": 1e-6, "model.rope_theta": 50000.0,
        "model.layer_types": PATTERN, "model.sliding_window": WINDOW,
        "model.attention": "xla", "train.global_batch": 1, **extra, **overrides})


def _hf_model(cfg, seed: int = 0):
    """A transformers model of cfg's shape and pattern, random weights (norm weights of
    either sign around Gemma's 1 + w, around 1 for Qwen)."""
    import torch
    import transformers

    m = cfg.model
    shape = dict(hidden_size=m.d_model, num_hidden_layers=m.num_layers,
                 num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                 head_dim=m.head_dim, intermediate_size=m.mlp_dim, vocab_size=m.vocab_size,
                 max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
                 layer_types=HF_TYPES, sliding_window=WINDOW, bos_token_id=0, eos_token_id=0,
                 pad_token_id=None)
    if m.family == "gemma3":
        config = transformers.Gemma3TextConfig(
            **shape, query_pre_attn_scalar=m.attention_scale_dim,
            final_logit_softcapping=m.final_logit_softcap,
            rope_parameters={"full_attention": {"rope_type": "default",
                                                "rope_theta": m.rope_theta},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": m.rope_local_theta}})
        config._attn_implementation = "eager"
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**shape, use_sliding_window=True,
                                          rope_theta=m.rope_theta, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.03 if "embed" in name else 0.1)
            if "norm" in name:
                p.normal_(0.0, 1.0) if m.family == "gemma3" else p.add_(1.0)
    return model.float().eval()


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_layer_pattern_imports_exports_and_decodes_as_transformers(family, tmp_path,
                                                                     devices):
    import transformers
    from helpers import assert_greedy_decode_equals_transformers

    cfg = _config(family)
    model = _hf_model(cfg)
    model.save_pretrained(tmp_path / "hf")
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    assert setup.spec.layer_types == ("sliding", "full", "sliding")
    tokens = random_tokens(cfg, batch=2)
    want = hf_logits(model, tokens)
    err = np.abs(jax_logits(setup, state.params, tokens) - want).max()
    assert err < TOLERANCE, err
    attention = model.config._attn_implementation
    # The window shows: the same model with every layer full gives other logits.
    model.config.layer_types = ["full_attention"] * 3
    model.model.config.layer_types = model.config.layer_types
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
        if hasattr(layer, "attention_type"):
            layer.attention_type = "full_attention"
    assert np.abs(hf_logits(model, tokens) - want).max() > 1e-3
    export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation=attention).eval()
    assert again.config.layer_types == HF_TYPES and again.config.sliding_window == WINDOW
    np.testing.assert_array_equal(hf_logits(again, tokens), want)
    # Greedy decoding through the kv cache, 20 tokens past the window.
    assert_greedy_decode_equals_transformers(setup, state, again, new_tokens=20)


def test_what_cannot_take_a_pattern_is_refused_in_one_line(tmp_path, devices):
    """Config errors name the key before anything compiles; a checkpoint format with one
    window for every layer refuses a mixed pattern on import and on export."""
    import transformers

    from jaxtrain.config import validate
    from jaxtrain.hf.save import _check_exportable
    from jaxtrain.models.transformer import ModelSpec

    cases = [
        ({"model.layer_types": "sliding,global"}, r"model.layer_types='sliding,global' is "
         r"invalid: 'global' is no layer kind: valid kinds are full, sliding"),
        ({"model.sliding_window": 0}, r"has sliding layers: set model.sliding_window"),
        ({"model.layer_types": "full,full,full,full"}, r"names 4 layers, more than"),
        ({"model.attention": "pallas"}, r"model.attention='pallas' is invalid: it has no "
         "sliding window"),
        ({"model.num_layers": 4, "model.moe.num_experts": 4, "model.moe.every_n_layers": 2,
          "model.family": "llama"}, r"mixes kinds within MoE group 0"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            validate(_config("qwen3", **overrides), 1, "cpu")
        assert "\n" not in str(e.value)
    # A pattern without sliding layers needs no window from the kernel.
    validate(_config("qwen3", **{"model.attention": "pallas", "model.layer_types": "full"}),
             1, "cpu")
    with pytest.raises(ConfigError, match=r"mesh.pipeline=3 needs one kind in every layer"):
        validate(_config("qwen3", **{"mesh.pipeline": 3}), 3, "cpu")
    spec = ModelSpec.from_config(_config("llama"))
    with pytest.raises(ConfigError, match=r"HF llama has one window for every layer"):
        from jaxtrain.hf import module_for
        _check_exportable(spec, module_for(spec))
    # Mistral's transformers model windows every layer: a mixed pattern does not import.
    cfg = _config("mistral")
    m = cfg.model
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        hidden_size=m.d_model, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, intermediate_size=m.mlp_dim,
        vocab_size=m.vocab_size, sliding_window=WINDOW))
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"gives windows S8,F,S8 but config.json "
                       r"sliding_window \(on every layer") as e:
        import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_the_planner_counts_each_kinds_keys_as_its_mask_does():
    """attention_flops_per_token against the masks themselves: the (query, key) pairs each
    layer's causal or windowed mask keeps, counted in float64."""
    from jaxtrain.models.flops import attention_flops_per_token
    from jaxtrain.models.transformer import ModelSpec

    for pattern, window in (("sliding,full", WINDOW), ("full", WINDOW), ("", WINDOW), ("", 0)):
        spec = ModelSpec.from_config(_config("qwen3", **{"model.layer_types": pattern,
                                                         "model.sliding_window": window}))
        s = spec.seq_len
        q, k = np.arange(s)[:, None], np.arange(s)[None, :]
        want = 0.0
        for kind in spec.layer_types or ("uniform",) * spec.num_layers:
            w = window if kind != "full" else 0
            mask = (k <= q) & ((q - k < w) if w else True)
            # The planner's keys per query leave out the query's own key, half a key per
            # query on average: (s+1)/2 kept under the causal mask, s/2 counted.
            keys = mask.sum(dtype=np.float64) / s - (w / (2 * s) if w else 0.5)
            # 2 matmuls × 2 FLOPs × 3 (forward and backward) per key, head and head dim
            want += 12 * keys * spec.num_heads * spec.head_dim
        np.testing.assert_allclose(attention_flops_per_token(spec), want, rtol=1e-12)


def test_moe_groups_of_each_kind_decode_as_the_full_forward(devices):
    """The walker's runs with MoE layers between (every layer MoE, kinds sliding, full,
    sliding: three runs): kv-cached decoding gives the full forward's logits past the
    window."""
    from helpers import assert_cached_decoding_matches_full_forward

    from jaxtrain.models.stack import Groups
    from jaxtrain.train.setup import build

    cfg = _config("llama", **{"model.sliding_window": 4, "model.moe.num_experts": 4,
                              "model.moe.dispatch": "capacity", "model.init_std": 0.3,
                              "model.moe.capacity_factor": 4.0})
    setup = build(cfg, devices[:1])
    assert Groups.of(setup.spec).runs == (("sliding", 0, 1), ("full", 1, 2), ("sliding", 2, 3))
    assert_cached_decoding_matches_full_forward(setup, setup.init_state().params)


@pytest.mark.slow
def test_a_pattern_trains_with_the_chunked_kernel_as_with_xla(devices):
    """A dense pattern trained 2 steps with the chunked kernel (each run's window a static
    argument, its own mask) gives xla's losses and parameters."""
    from helpers import assert_params_close, train_steps

    dense = {"model.sliding_window": 4, "train.global_batch": 2}
    xla_losses, xla_params, _ = train_steps(_config("llama", **dense), devices[:1], steps=2)
    losses, params, _ = train_steps(_config("llama", **dense, **{"model.attention": "chunked"}),
                                    devices[:1], steps=2)
    np.testing.assert_allclose(losses, xla_losses, rtol=1e-5)
    assert_params_close(params, xla_params)


def _steps_with_grad_norms(cfg, devices, steps: int = 2):
    from helpers import first_batches, stepping

    from jaxtrain.train.setup import build

    setup = build(cfg, devices)
    after = list(stepping(setup, setup.init_state(), first_batches(cfg, steps)))
    out = [(float(m["loss"]), float(m["grad_norm"])) for _, m in after]
    return np.array(out), setup, after[-1][0]


@pytest.mark.slow  # 13 s; the fast tier walks patterns in the decode and import tests
def test_a_repeating_pattern_walks_by_periods_as_by_runs(devices, monkeypatch):
    """Five layers sliding, full, sliding, full, sliding: walked as two periods of (sliding,
    full) in one outer scan and a last run (3 compiled bodies, not 5), the losses, grad norms,
    parameters and kv-cached decoding equal the run-by-run walk's."""
    from helpers import assert_cached_decoding_matches_full_forward, assert_params_close

    from jaxtrain.models import ModelSpec, stack

    cfg = _config("llama", **{"model.num_layers": 5, "model.sliding_window": 4,
                              "train.global_batch": 2})
    runs = stack.Groups.of(ModelSpec.from_config(cfg)).runs
    assert stack._period(runs, 5) == ((("sliding", 0, 1), ("full", 1, 2)), 2, 2)
    by_periods, setup, state = _steps_with_grad_norms(cfg, devices[:1])
    assert_cached_decoding_matches_full_forward(setup, state.params)
    monkeypatch.setattr(stack, "_period", lambda runs, count: None)
    by_runs, _, runs_state = _steps_with_grad_norms(cfg, devices[:1])
    np.testing.assert_allclose(by_periods, by_runs, rtol=1e-6)
    assert_params_close(state.params, runs_state.params)
