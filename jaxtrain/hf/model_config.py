"""A run's model config from a Hugging Face config.json: each family's config checks read
the other way (hf/mapping.py `deriving`), so that one table per family serves import with
and without --config.

`resolve` fills every model key the user did not give from config.json; the given ones stay
and are then checked against config.json as before (hf/load.py), floats within
mapping.FLOAT_REL_TOL. Keys config.json does not speak of keep the config's values, but for:
- model.family: the family module's;
- model.moe.dispatch: dropless for a model with experts, so that evaluation, generation
  and export compute what transformers computes (capacity dispatch drops tokens);
- model.seq_len: at most config.json's max_position_embeddings (GPT-2: n_positions).
"""

from __future__ import annotations

import contextlib
import io

import ml_collections

from jaxtrain.errors import ConfigError
from jaxtrain.hf.mapping import deriving, same_value

PASSES = 4  # the checks branch on the model (a rope type's fields): enough to settle


def flat(section, prefix: str = "model") -> dict:
    """{'model.d_model': 576, 'model.moe.top_k': 2, ...} of a config section."""
    out = {}
    for key, value in section.items():
        name = f"{prefix}.{key}"
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            out.update(flat(value, name))
        else:
            out[name] = value
    return out


def given_keys(model, default_model) -> set[str]:
    """The model keys a config sets to other than their defaults: the ones it gives."""
    defaults = flat(default_model)
    return {k for k, v in flat(model).items() if k not in defaults or v != defaults[k]}


def _typed(current, value):
    """`value` in the type of the config's `current` (config.json's 10000 for a float key)."""
    if isinstance(current, bool) or current is None:
        return value
    if isinstance(current, float) and isinstance(value, int):
        return float(value)
    if isinstance(current, int) and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _set(model, key: str, value) -> bool:
    """Sets dotted 'model.a.b' on cfg.model; whether it changed."""
    *parents, leaf = key.split(".")[1:]
    section = model
    for part in parents:
        section = section[part]
    if leaf not in section:
        return False
    value = _typed(section[leaf], value)
    if same_value(section[leaf], value) and type(section[leaf]) is type(value):
        return False
    try:
        section[leaf] = value
    except (TypeError, ValueError):
        raise ConfigError(f"config.json gives {key} the value {value!r}, which is no "
                          f"{type(section[leaf]).__name__}") from None
    return True


def derive(hf: dict, family, model, given: set[str]) -> dict:
    """config.json's value of every key the family's checks read, applied to `model` (a
    cfg.model, changed in place) but for the `given` keys; returns them."""
    derived: dict = {}
    for _ in range(PASSES):
        # Quiet: a check's notes are printed once, by the import's own check.
        with deriving() as found, contextlib.redirect_stderr(io.StringIO()):
            try:
                family.check_config(hf, model)
            except (TypeError, ValueError) as e:  # a string where a number belongs
                raise ConfigError(f"config.json holds a value of the wrong type: {e}") from None
        changed = [_set(model, k, v) for k, v in found.items() if k not in given]
        derived.update({k: v for k, v in found.items() if k not in given})
        if not any(changed):
            break
    return derived


def resolve(cfg, hf: dict, family, given: set[str] | None = None):
    """A copy of `cfg` whose model keys not in `given` (None: none given, the config is
    base_config's) come from config.json."""
    cfg = cfg.copy_and_resolve_references()
    given = set() if given is None else given
    m = cfg.model
    if "model.family" not in given:
        m.family = family.FAMILY
    derive(hf, family, m, given)
    if m.moe.num_experts and "model.moe.dispatch" not in given:
        m.moe.dispatch = "dropless"
    positions = hf.get("max_position_embeddings", hf.get("n_positions"))
    if "model.seq_len" not in given and isinstance(positions, int) and positions < m.seq_len:
        m.seq_len = positions
    return cfg
