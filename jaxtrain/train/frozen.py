"""The frozen models of a state (TrainState.frozen), one loader for every role.

A role (ROLES) is one frozen model a run may hold:
- `base`, LoRA's frozen base: `model.lora.base`'s newest checkpoint's parameters in
  model.lora.base_dtype's stored form;
- `reference`, DPO's reference without LoRA: `train.dpo.reference`'s, a frozen copy of the
  starting parameters; a fresh run starts its trained parameters from it (DPO starts the
  policy where the reference is), so the state holds the parameters twice (with LoRA the
  base is the reference and no copy is held).

Each is a run directory (what `jaxtrain convert --from-hf` or any training run writes), or,
empty, the model initialised from `seed`. It is loaded straight into its shards at the
start of every run, fresh or resumed, and never saved: a checkpoint holds its fingerprint,
a sha256 over the exact per-leaf bit sums (checkpoint.tree_bits: the same on every mesh) of
the form the state holds (so another storage kind is another base), which a resume
compares, and so does every command that loads a LoRA run (on_base, through
inference.load). Its shapes are checked against the model from its checkpoint's metadata
before anything is restored, and a run checks its sources (check_sources) before it
writes its workdir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import storage
from jaxtrain.checkpoint import Checkpoints, tree_bits, tree_signature
from jaxtrain.errors import CheckpointError, ConfigError
from jaxtrain.models import lora
from jaxtrain.train.state import (
    BASE,
    REFERENCE,
    Frozen,
    TrainState,
    abstract_model,
    create_base,
    param_shardings,
    stored_base,
)
from jaxtrain.workdir import CHECKPOINTS


def fingerprint(params: dict) -> np.ndarray:
    """uint32[8]: sha256 of every leaf's exact bit sum, by path."""
    sums = tree_bits({"base": params})
    digest = hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).digest()
    return np.frombuffer(digest, np.uint32).copy()


def load_base(cfg, spec, shardings: dict) -> dict:
    """The frozen base parameters in model.lora.base_dtype's stored form, in `shardings`
    (TrainState's: state.stored_base_shardings). They are read in float32 and stored in one
    jit, which frees the float32 copy."""
    mesh = jax.tree.leaves(shardings)[0].mesh
    full = param_shardings(abstract_model(lora.base_spec(spec)), mesh, spec.rules)
    params = load_params(cfg.model.lora.base, "model.lora.base", cfg.seed, spec, full)
    if spec.lora.base_dtype == "float32":
        return params
    with jax.set_mesh(mesh), warnings.catch_warnings():
        # The vectors stay float32 (the same buffers): their donation is declined.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        return jax.jit(functools.partial(stored_base, spec), out_shardings=shardings,
                       donate_argnums=0)(params)


def check_sources(setup) -> None:
    """The run directories a run's frozen models come from (each role's key: LoRA's
    model.lora.base, DPO's train.dpo.reference) hold a checkpoint that fits the model, from
    its metadata (nothing restored): called before the workdir is written, so that a
    missing or misshapen one is refused (ConfigError, one line) before anything else
    happens."""
    for name in setup.shardings.frozen:
        key = ROLES[name].key_of(setup.cfg)
        if source := _source(setup.cfg, key):
            with _newest(source, key) as (checkpoints, step):
                _check_fits(checkpoints, step, _base_shapes(setup.spec), key, source)


def _source(cfg, key: str) -> str:
    """The value of the dotted config key `key` (a role's run directory)."""
    return functools.reduce(getattr, key.split("."), cfg)


def load_params(source: str, key: str, seed: int, spec, shardings: dict) -> dict:
    """The parameters of the model without adapters in `shardings`: the newest checkpoint
    of the run directory `source` (the config key `key` names it), or initialised from
    `seed` when it is empty; ConfigError (one line) when it holds none that fits."""
    if not source:
        mesh = jax.tree.leaves(shardings)[0].mesh
        with jax.set_mesh(mesh):
            return jax.jit(lambda key: create_base(spec, key), out_shardings=shardings)(
                jax.random.key(seed))
    shapes = _base_shapes(spec)
    with _newest(source, key) as (checkpoints, step):
        _check_fits(checkpoints, step, shapes, key, source)  # before orbax sees a misfit
        return checkpoints.restore_params(step, jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes, shardings))


@contextlib.contextmanager
def _newest(source: str, key: str):
    """(Checkpoints, newest intact step) of the run directory `source`, opened read-only;
    ConfigError (one line) where it holds none."""
    workdir = storage.as_path(source, key)
    if not (workdir / CHECKPOINTS).is_dir():
        raise ConfigError(f"{key}={source!r} holds no {CHECKPOINTS}/ directory: name a run "
                          "directory (jaxtrain convert --from-hf ... --workdir BASE, or a "
                          "training run)")
    checkpoints = Checkpoints(workdir / CHECKPOINTS, keep=1_000_000, log=lambda _: None,
                              read_only=True)
    try:
        try:
            step, _ = checkpoints.latest_intact()
        except CheckpointError as e:
            raise ConfigError(f"{key}={source!r} holds no usable checkpoint ({e}); name a "
                              "run directory (jaxtrain convert --from-hf ... --workdir BASE, "
                              "or a training run)") from None
        yield checkpoints, step
    finally:
        checkpoints.close()


def _base_shapes(spec) -> dict:
    """ShapeDtypeStructs of the parameters of the model without adapters."""
    return jax.eval_shape(lambda: create_base(spec, jax.random.key(0)))


def _check_fits(checkpoints: Checkpoints, step: int, shapes: dict, key: str,
                source: str) -> None:
    """ConfigError naming the first parameter whose saved shape is not this model's (or
    that one side lacks), with both shapes, from the step's metadata."""
    saved = {path: shape for path, (shape, _) in checkpoints.signature(step).items()
             if path[:1] == ("params",)}  # dtypes may differ: orbax casts on restore
    wanted = {path: shape for path, (shape, _) in tree_signature({"params": shapes}).items()}
    problem = next((f"{'/'.join(p[1:])} is {list(saved[p])} there, {list(wanted[p])} here"
                    for p in sorted(wanted) if p in saved and saved[p] != wanted[p]), None)
    problem = problem or next((f"it lacks {'/'.join(p[1:])} {list(wanted[p])}"
                               for p in sorted(wanted) if p not in saved), None)
    problem = problem or next((f"it has {'/'.join(p[1:])} {list(saved[p])}, which this model "
                               "lacks" for p in sorted(saved) if p not in wanted), None)
    if problem:
        raise ConfigError(f"{key}={source!r}: its step {step} does not fit this model "
                          f"({problem}); name a run of the same model.* shape")


def on_base(cfg, spec, shardings: dict, adapters: dict, saved_fingerprint) -> dict:
    """The whole model's parameters: a LoRA run's `adapters` joined to model.lora.base,
    which must be the base they were trained on (`saved_fingerprint`, from their
    checkpoint): ConfigError (one line) for a base changed since. What every command that
    loads a LoRA run (inference.load: eval, generate, quantize, export) goes through."""
    base = load_base(cfg, spec, shardings)
    check_same(saved_fingerprint, fingerprint(base), f"{_named(cfg)} is not the base these "
               "adapters were trained on", "put that base back there (and its "
               "model.lora.base_dtype), or train the adapters again on this one")
    return lora.join(base, adapters)


def _reference_key(cfg) -> str:
    """The config key of the reference's run directory: the objective's own section's
    (train.dpo.reference, train.grpo.reference)."""
    section = cfg.train.get(cfg.train.objective)
    has_own = section is not None and "reference" in section
    return f"train.{cfg.train.objective}.reference" if has_own else "train.dpo.reference"


def _load_reference(cfg, spec, shardings: dict) -> dict:
    key = _reference_key(cfg)
    return load_params(_source(cfg, key), key, cfg.seed, spec, shardings)


def _reference_named(cfg) -> str:
    key = _reference_key(cfg)
    return f"{key}={_source(cfg, key)!r}"


@dataclasses.dataclass(frozen=True)
class Role:
    """One kind of frozen model a state holds (TrainState.frozen's keys)."""

    name: str
    key: str  # the config key naming the run directory it is loaded from
    # (cfg, spec, its parameters' shardings) -> its parameters as the state holds them
    load: Callable
    named: Callable  # (cfg) -> how the config names it, for the refusal
    mismatch: str  # "<named> <mismatch> (fingerprint ...)": a resume on another one
    remedy: str
    starts_training: bool = False  # a fresh run's trained parameters start as a copy of it
    # (cfg) -> the key, where it depends on the config (None: `key`)
    key_for: Callable | None = None

    def key_of(self, cfg) -> str:
        return self.key if self.key_for is None else self.key_for(cfg)


ROLES: dict[str, Role] = {r.name: r for r in (
    Role(BASE, "model.lora.base", load_base, lambda cfg: _named(cfg),
         "is not the base these adapters were trained on",
         "resume with the same base and model.lora.base_dtype"),
    Role(REFERENCE, "train.dpo.reference", _load_reference, _reference_named,
         "is not the reference this run was trained against", "resume with the same reference",
         starts_training=True, key_for=_reference_key),
)}


def load(role: str, cfg, spec, shardings: TrainState) -> dict:
    """The parameters of the state's frozen model `role`, loaded as a run loads them (in
    `shardings`, the state's: Setup.shardings)."""
    return ROLES[role].load(cfg, spec, shardings.frozen[role].params)


def attach(state: TrainState, cfg, spec, shardings: TrainState, fresh: bool) -> TrainState:
    """`state` with each of its frozen models (shardings.frozen's roles) loaded; a fresh
    state records their fingerprints (and starts its parameters from a role that says so),
    a restored one must have been trained with the same ones (ConfigError, one line,
    naming the first that differs)."""
    frozen = {}
    for name, sharding in shardings.frozen.items():
        role = ROLES[name]
        params = role.load(cfg, spec, sharding.params)
        found = fingerprint(params)
        if fresh:
            recorded = jax.device_put(found, sharding.fingerprint)
            if role.starts_training:  # own buffers: the step donates them, never the frozen
                state = state.replace(params=jax.tree.map(jnp.copy, params))
        else:
            recorded = state.frozen[name].fingerprint
            check_same(recorded, found, f"{role.named(cfg)} {role.mismatch}", role.remedy)
        frozen[name] = Frozen(params, recorded)
    return state.replace(frozen=frozen)


def _named(cfg) -> str:
    """The base as the config names it: its run directory and its storage kind (the
    fingerprint is over the stored form, so another kind is another base)."""
    lora_cfg = cfg.model.lora
    return (f"model.lora.base={lora_cfg.base!r} stored as model.lora.base_dtype="
            f"{lora_cfg.base_dtype!r}")


def check_same(saved, found: np.ndarray, mismatch: str, remedy: str) -> None:
    """ConfigError unless a checkpoint's fingerprint (`saved`, on device) is `found`:
    "MISMATCH (fingerprint ..., the checkpoint's ...); REMEDY"."""
    saved = np.asarray(jax.device_get(saved))
    if not np.array_equal(saved, found):
        raise ConfigError(f"{mismatch} (fingerprint {_hex(found)}, the checkpoint's "
                          f"{_hex(saved)}); {remedy}")


def _hex(words: np.ndarray) -> str:
    return np.asarray(words, np.uint32).tobytes().hex()[:12]
