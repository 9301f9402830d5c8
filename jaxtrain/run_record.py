"""A run's recorded config (WORKDIR/config.json: the config of its newest session, or of its
import) as the config of its next session, so that `jaxtrain train --workdir RUN` continues
or fine-tunes a run without repeating its config and model overrides.

The record is the workdir's, or for a new LoRA run model.lora.base's (an import's):
- No --config: the record, with the command line's --config.KEY=VALUE overrides.
- A --config (training settings): each model key it leaves at its default, and no override
  sets, is the record's.
"""

from __future__ import annotations

import json
import sys

from jaxtrain import storage
from jaxtrain.config import base_config
from jaxtrain.errors import ConfigError
from jaxtrain.hf.model_config import flat
from jaxtrain.workdir import CONFIG_FILE


def recorded(workdir):
    """The config recorded in `workdir` (base_config() updated with it), or None."""
    try:
        text = (storage.as_path(workdir, "--workdir") / CONFIG_FILE).read_text()
    except Exception as e:  # noqa: BLE001 - a bucket's own errors: the user's, in one line
        problem = storage.user_error(e, "--workdir", workdir)
        if problem is not None:
            raise problem from None
        if isinstance(e, FileNotFoundError):
            return None
        raise
    try:
        saved = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{workdir}/{CONFIG_FILE} is not JSON ({e})") from None
    cfg = base_config()  # keys added since the run was recorded keep their defaults
    cfg.update(saved)
    cfg.mesh.rules = tuple(tuple(rule) for rule in cfg.mesh.rules)  # JSON made them lists
    return cfg


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def _put(cfg, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        cfg = cfg[part]
    cfg[leaf] = value


def session_config(cfg, workdir, config_given: bool, overrides: set[str]):
    """The config the session trains with (module docstring); ConfigError (one line) for
    no --config and no record."""
    lora_base = cfg.model.lora.base
    source = recorded(workdir) or (recorded(lora_base) if lora_base else None)
    if not config_given:
        if source is None:
            raise ConfigError(f"--config is required: --workdir={workdir} holds no "
                              f"{CONFIG_FILE} of an earlier run or import (nor does a "
                              "model.lora.base given)")
        recorded_dispatch = source.model.moe.dispatch
        for key in overrides:
            _put(source, key, _get(cfg, key))
        _warn_capacity(source, recorded_dispatch)
        return source
    if source is None:
        return cfg
    cfg = cfg.copy_and_resolve_references()
    defaults = flat(base_config().model)
    for key, value in flat(source.model).items():
        if key.startswith("model.lora.") or key in overrides or key not in defaults:
            continue
        if _get(cfg, key) == defaults[key] and value != defaults[key]:
            _put(cfg, key, value)
    _warn_capacity(cfg, source.model.moe.dispatch)
    return cfg


def _warn_capacity(cfg, recorded_dispatch: str) -> None:
    """One line when an MoE model recorded dropless (an import's default) trains with a
    capacity: tokens past it are dropped."""
    moe = cfg.model.moe
    if moe.num_experts and recorded_dispatch == "dropless" and moe.dispatch != "dropless":
        print(f"jaxtrain: model.moe.dispatch={moe.dispatch!r}: an expert takes at most "
              f"capacity_factor={moe.capacity_factor} times its share of tokens and drops the "
              "rest (the import ran dropless: --config.model.moe.dispatch=dropless keeps "
              "them)", file=sys.stderr, flush=True)
