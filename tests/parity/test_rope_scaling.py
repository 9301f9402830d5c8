"""model.rope_scaling (models/rope.py): Llama-3 and YaRN frequencies against transformers, and
their config.json mapping both ways (hf/llama.py)."""

import json

import numpy as np
import pytest
from hf_parity import hf_logits, jax_logits, random_tokens
from test_convert import TOLERANCE, _config, _hf_model

from jaxtrain.config import ConfigError, validate
from jaxtrain.hf.load import import_hf
from jaxtrain.hf.save import export_hf

# Original lengths short enough that, at head_dim 16, some frequencies are kept, some
# interpolated and some blended: every branch of both formulas is exercised.
SCALINGS = {
    "llama3": {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
             "beta_slow": 1.0},
}


def _scaled_config(kind: str):
    return _config("llama", **{"model.rope_scaling.type": kind,
                               **{f"model.rope_scaling.{k}": v
                                  for k, v in SCALINGS[kind].items()}})


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_scaled_rope_imports_and_exports_with_the_logits_of_transformers(kind, tmp_path,
                                                                          devices):
    import transformers

    cfg = _scaled_config(kind)
    model = _hf_model(cfg, rope_parameters={"rope_type": kind, "rope_theta": 10000.0,
                                            **SCALINGS[kind]})
    model.save_pretrained(tmp_path / "hf")
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    tokens = random_tokens(cfg, batch=2)
    want = hf_logits(model, tokens)
    err = np.abs(jax_logits(setup, state.params, tokens) - want).max()
    assert err < TOLERANCE, err
    # Scaling changed the numbers: plain RoPE is far from them.
    plain = _config("llama")
    plain_setup, plain_state = import_hf(plain, _plain_copy(tmp_path), tmp_path / "plain",
                                         devices[:1])
    assert np.abs(jax_logits(plain_setup, plain_state.params, tokens) - want).max() \
        > 100 * TOLERANCE
    export_hf(tmp_path / "run", tmp_path / "out", devices=devices[:1])
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["rope_parameters"]["rope_type"] == kind
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert np.abs(hf_logits(back, tokens) - want).max() < TOLERANCE


def _plain_copy(tmp_path):
    """The same weights with config.json's RoPE unscaled."""
    import shutil

    plain = tmp_path / "hf_plain"
    shutil.copytree(tmp_path / "hf", plain)
    hf = json.loads((plain / "config.json").read_text())
    hf.pop("rope_scaling", None)
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(hf))
    return plain


def test_rope_scaling_mismatches_and_bad_values_are_one_line_errors(tmp_path, devices):
    cfg = _scaled_config("llama3")
    _hf_model(cfg, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                    **SCALINGS["llama3"], "factor": 8.0}
              ).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"model.rope_scaling.factor=4.0 but config.json "
                                          r"rope_parameters.factor=8.0"):
        import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices[:1])
    with pytest.raises(ConfigError, match="model.rope_scaling.type='none' but config.json "
                                          "rope_parameters.rope_type='llama3'"):
        import_hf(_config("llama"), tmp_path / "hf", tmp_path / "run2", devices[:1])
    for overrides, message in [
        ({"model.rope_scaling.type": "ntk"},
         "model.rope_scaling.type='ntk' is invalid: valid values are none, llama3, yarn"),
        ({"model.rope_scaling.type": "yarn", "model.rope_scaling.factor": 0.5},
         "model.rope_scaling.factor=0.5 is invalid: must be >= 1"),
        ({"model.rope_scaling.type": "llama3", "model.rope_scaling.high_freq_factor": 1.0},
         "model.rope_scaling.high_freq_factor=1.0 is invalid: must be > "),
    ]:
        with pytest.raises(ConfigError) as e:
            validate(_config("llama", **overrides), 1)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.rope_scaling.type='yarn' is invalid: "
                                          "model.family='gpt2' has learned positions"):
        validate(_config("gpt2", **{"model.rope_scaling.type": "yarn"}), 1)
