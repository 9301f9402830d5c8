"""tests/make_hf_model.py, the fixture of docs/interop.md's worked examples: what it saves
is what its docstring says, a model of configs/tiny.py's shapes that `jaxtrain convert
--from-hf` reads with no --config."""

import pathlib

import pytest
from make_hf_model import main

from jaxtrain.commands.convert import import_config
from jaxtrain.config import base_config, load_config_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPE = ("d_model", "num_layers", "num_heads", "mlp_dim", "vocab_size", "seq_len")


@pytest.mark.parametrize("family,flags", [("gpt2", []),
                                          ("llama", ["--tied", "--rope_theta", "100000"])])
def test_the_fixture_has_tiny_shapes_and_imports_without_a_config(family, flags, tmp_path,
                                                                   capsys):
    main(["--family", family, "--out", str(tmp_path), *flags])
    assert capsys.readouterr().out.rstrip().endswith(f"parameters) to {tmp_path}")
    tiny = load_config_file(str(ROOT / "configs/tiny.py")).model
    model = import_config(base_config(), tmp_path, None).model
    assert model.family == family
    assert {k: model[k] for k in SHAPE} == {k: tiny[k] for k in SHAPE}
    if family == "llama":
        assert model.num_kv_heads == 2 and model.tie_embeddings and model.rope_theta == 1e5
