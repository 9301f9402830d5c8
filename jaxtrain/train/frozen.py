"""LoRA's frozen base: where it comes from, its fingerprint, and joining it to a state.

The base is `model.lora.base`'s newest checkpoint's parameters (a run directory: what
`jaxtrain convert --from-hf` or any training run writes), or, empty, the model initialised
from `seed`. It is loaded straight into its shards at the start of every run, fresh or
resumed, and never saved: a LoRA checkpoint holds the adapters, their optimizer state, the
step and the base's fingerprint, a sha256 over the exact per-leaf bit sums
(checkpoint.tree_bits: the same on every mesh), which a resume compares.
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np

from jaxtrain import storage
from jaxtrain.checkpoint import Checkpoints, tree_bits
from jaxtrain.errors import CheckpointError, ConfigError
from jaxtrain.train.state import TrainState, create_base
from jaxtrain.workdir import CHECKPOINTS


def fingerprint(params: dict) -> np.ndarray:
    """uint32[8]: sha256 of every leaf's exact bit sum, by path."""
    sums = tree_bits({"base": params})
    digest = hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).digest()
    return np.frombuffer(digest, np.uint32).copy()


def load_base(cfg, spec, shardings: dict) -> dict:
    """The frozen base parameters, in `shardings` (the model's without adapters)."""
    return load_params(cfg.model.lora.base, "model.lora.base", cfg.seed, spec, shardings)


def load_params(source: str, key: str, seed: int, spec, shardings: dict) -> dict:
    """The parameters of the model without adapters in `shardings`: the newest checkpoint
    of the run directory `source` (the config key `key` names it), or initialised from
    `seed` when it is empty; ConfigError (one line) when it holds none that fits."""
    if not source:
        mesh = jax.tree.leaves(shardings)[0].mesh
        with jax.set_mesh(mesh):
            return jax.jit(lambda key: create_base(spec, key), out_shardings=shardings)(
                jax.random.key(seed))
    workdir = storage.as_path(source, key)
    checkpoints = Checkpoints(workdir / CHECKPOINTS, keep=1_000_000, log=lambda _: None,
                              read_only=True)
    try:
        step, _ = checkpoints.latest_intact()
        try:
            return checkpoints.restore_params(step, _abstract(spec, shardings))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{key}={source!r}: its step {step} does not fit this "
                              f"model ({str(e).splitlines()[0][:160]}); name a run of the "
                              "same model.* shape") from None
    except CheckpointError as e:
        raise ConfigError(f"{key}={source!r} holds no usable checkpoint ({e}); "
                          "name a run directory (jaxtrain convert --from-hf ... --workdir "
                          "BASE, or a training run)") from None
    finally:
        checkpoints.manager.close()


def _abstract(spec, shardings: dict) -> dict:
    """ShapeDtypeStructs of the base parameters, with `shardings` as their .sharding."""
    shapes = jax.eval_shape(lambda: create_base(spec, jax.random.key(0)))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def attach(state: TrainState, cfg, spec, shardings: TrainState, fresh: bool) -> TrainState:
    """`state` with its frozen base loaded; a fresh state records the base's fingerprint,
    a restored one must have been trained on the same base (ConfigError otherwise)."""
    base = load_base(cfg, spec, shardings.frozen)
    found = fingerprint(base)
    if fresh:
        return state.replace(frozen=base, base_fingerprint=jax.device_put(
            found, shardings.base_fingerprint))
    check_same(state.base_fingerprint, found, f"model.lora.base={cfg.model.lora.base!r} "
               "is not the base these adapters were trained on", "the same base")
    return state.replace(frozen=base)


def check_same(saved, found: np.ndarray, mismatch: str, remedy: str) -> None:
    """ConfigError unless a checkpoint's fingerprint (`saved`, on device) is `found`:
    "MISMATCH (fingerprint ..., the checkpoint's ...); resume with REMEDY"."""
    saved = np.asarray(jax.device_get(saved))
    if not np.array_equal(saved, found):
        raise ConfigError(f"{mismatch} (fingerprint {_hex(found)}, the checkpoint's "
                          f"{_hex(saved)}); resume with {remedy}")


def _hex(words: np.ndarray) -> str:
    return np.asarray(words, np.uint32).tobytes().hex()[:12]
