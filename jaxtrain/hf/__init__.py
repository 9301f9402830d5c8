"""Hugging Face checkpoint families: one module per model_type, each describing its config
checks, its tensors and its exported config.json (see jaxtrain/commands/convert.py)."""

from jaxtrain.errors import ConfigError
from jaxtrain.hf import (
    deepseek_v3,
    gemma,
    gpt2,
    gpt_oss,
    llama,
    llama_like,
    mistral4,
    mixtral,
    qwen3_5,
    qwen3_moe,
)

# HF model_type -> module; each module's FAMILY is the jaxtrain model.family it maps to.
FAMILIES = {"gpt2": gpt2, "llama": llama, "mixtral": mixtral, **llama_like.ENTRIES,
            **gemma.ENTRIES, "qwen3_moe": qwen3_moe, "gpt_oss": gpt_oss,
            "deepseek_v3": deepseek_v3, "mistral4": mistral4, "qwen3_5_text": qwen3_5,
            "qwen3_5": qwen3_5.WITH_VISION}


def module_for(spec):
    """The HF module a model exports as: its family's, or with experts the one its family
    module names as MOE (Mixtral for a llama); ConfigError for a family without one."""
    if spec.moe is None:  # keyed by model_type, which may differ from the family's name
        return FAMILIES.get(spec.family) or next(
            m for m in FAMILIES.values() if m.FAMILY == spec.family)
    moe = getattr(FAMILIES[spec.family], "MOE", None)
    if moe is None:
        raise ConfigError(f"model.family={spec.family!r} with model.moe has no Hugging Face "
                          "model_type here (an MoE model exports as mixtral: "
                          "model.family='llama', or as qwen3_moe: 'qwen3')")
    return FAMILIES[moe]


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


def families_rows() -> list[tuple[str, str, str]]:
    """(model_type, architecture, jaxtrain family) of every family module, registry order;
    an MoE model_type another family exports as (its MOE) reads 'llama + model.moe'."""
    moe_of = {getattr(m, "MOE", None) for m in FAMILIES.values()}
    return [(model_type, m.ARCHITECTURE,
             m.FAMILY + (" + model.moe" if model_type in moe_of and m.FAMILY != model_type
                         else ""))
            for model_type, m in FAMILIES.items()]


def families_help() -> str:
    """convert --help's list of the families, from FAMILIES."""
    rows = families_rows()
    width = max(len(t) for t, _, _ in rows) + 2
    arch = max(len(a) for _, a, _ in rows) + 2
    return ("Hugging Face families (config.json model_type, architecture -> jaxtrain "
            "model.family):\n" + "\n".join(f"  {t:<{width}}{a:<{arch}}-> {f}"
                                            for t, a, f in rows))


def families_table() -> str:
    """docs/interop.md's table of the families, from FAMILIES (a test keeps them equal)."""
    lines = ["| config.json model_type | architecture | jaxtrain model.family |",
             "|---|---|---|"]
    return "\n".join(lines + [f"| `{t}` | `{a}` | `{f}` |" for t, a, f in families_rows()])
