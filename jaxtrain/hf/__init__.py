"""Hugging Face checkpoint families: one module per model_type, each describing its config
checks, its tensors and its exported config.json (see jaxtrain/commands/convert.py)."""

from jaxtrain.errors import ConfigError
from jaxtrain.hf import gpt2, llama

FAMILIES = {"gpt2": gpt2, "llama": llama}  # HF model_type (= jaxtrain model.family) -> module


def family_of(hf: dict, where: str):
    """The family module of a config.json, or a one-line ConfigError naming what it is."""
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    module = FAMILIES.get(model_type)
    if module is None or (architectures and module.ARCHITECTURE not in architectures):
        supported = ", ".join(m.ARCHITECTURE for m in FAMILIES.values())
        raise ConfigError(f"{where}: model_type={model_type!r}, architectures="
                          f"{architectures} is not supported; jaxtrain converts {supported}")
    return module
