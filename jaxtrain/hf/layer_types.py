"""transformers' per-layer attention kinds (`layer_types`: sliding_attention, full_attention,
with `sliding_window`) against jaxtrain's model.layer_types and model.sliding_window, both
ways. Compared as each layer's window (None: full), which is what either side computes: a
model without a pattern (model.layer_types unset) is windowed everywhere or nowhere.
"""

from __future__ import annotations

from jaxtrain.models.families import LAYER_KINDS, UNIFORM, LayerKind, layer_pattern


def kinds(model) -> list[LayerKind]:
    """Each layer's kind entry of cfg.model (layer_types a string) or a ModelSpec (a tuple)."""
    names = model.layer_types
    if isinstance(names, str):
        names = layer_pattern(names, model.num_layers)
    return [LAYER_KINDS[k] for k in names] if names else [UNIFORM] * model.num_layers


def windows(model) -> list[int | None]:
    """Each layer's window (None: every earlier token)."""
    return [k.window(model) for k in kinds(model)]


def windowed_theta(model) -> float | None:
    """The rope theta of the windowed layers (one value: their kinds share it), or None."""
    thetas = {k.rope(model)[0] for k in kinds(model) if k.window(model)}
    return thetas.pop() if thetas else None


def hf_windows(hf: dict, types: list[str]) -> list[int | None]:
    """Each layer's window as transformers builds it from layer_types and sliding_window."""
    window = hf.get("sliding_window")
    return [window if t == "sliding_attention" else None for t in types]


def shown(windows_: list[int | None]) -> str:
    """A short form of a window list for one-line messages: S<w> or F per layer."""
    return ",".join("F" if w is None else f"S{w}" for w in windows_)


def check(c, m, hf: dict, types: list[str], where: str) -> None:
    """One problem in Checks `c` when cfg.model `m`'s windows differ from the checkpoint's."""
    ours, theirs = windows(m), hf_windows(hf, types)
    derive(c, theirs)
    if ours != theirs:
        c.problems.append(f"model.layer_types={m.layer_types!r} with model.sliding_window="
                          f"{m.sliding_window} gives windows {shown(ours)} but config.json "
                          f"{where} give {shown(theirs)} (S<w>: sliding, F: full)")


def derive(c, windows_: list[int | None]) -> None:
    """config.json's windows as model.layer_types and model.sliding_window (Checks.derive):
    no pattern when no layer is windowed, 'sliding' (repeated) when every layer is, else one
    kind per layer. Sliding layers, not uniform ones: those take model.rope_local_theta."""
    window = next((w for w in windows_ if w), 0)
    kinds = ["sliding" if w else "full" for w in windows_]
    c.derive("model.layer_types", "" if not window else
             "sliding" if set(kinds) == {"sliding"} else ",".join(kinds))
    c.derive("model.sliding_window", window)


def export(spec, unused_window: int | None = None) -> dict:
    """config.json's layer_types and sliding_window of a ModelSpec; unused_window: the
    sliding_window to write when no layer is windowed (transformers' Gemma builds the
    sliding mask even then, and refuses null)."""
    types = ["sliding_attention" if w else "full_attention" for w in windows(spec)]
    return {"layer_types": types, "sliding_window": spec.sliding_window or unused_window}
