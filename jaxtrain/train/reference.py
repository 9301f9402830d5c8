"""DPO's reference without LoRA: a frozen copy of the starting parameters in the state.

`train.dpo.reference` is a run directory whose newest checkpoint's parameters are the
reference (what `jaxtrain convert --from-hf` or an SFT run writes), or, empty, the model
initialised from `seed`. A fresh run starts its trained parameters from the reference (DPO
starts the policy where the reference is), so the state holds the parameters twice: the
trained ones and the reference (`TrainState.reference`, sharded like them; no gradient or
optimizer state). The reference is never checkpointed: every run, fresh or resumed, loads
it again, and a checkpoint holds its fingerprint (train/frozen.py), which a resume compares.
With LoRA the frozen base is the reference and nothing is loaded here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.train.frozen import check_same, fingerprint, load_params
from jaxtrain.train.state import TrainState


def attach(state: TrainState, cfg, spec, shardings: TrainState, fresh: bool) -> TrainState:
    """`state` with its reference loaded; a fresh state starts its parameters from it and
    records its fingerprint, a restored one must have been trained against the same
    reference (ConfigError otherwise)."""
    source = cfg.train.dpo.reference
    reference = load_params(source, "train.dpo.reference", cfg.seed, spec,
                            shardings.reference)
    found = fingerprint(reference)
    if fresh:
        # Own buffers: the step donates the trained parameters, never the reference.
        params = jax.tree.map(jnp.copy, reference)
        return state.replace(params=params, reference=reference,
                             reference_fingerprint=jax.device_put(
                                 found, shardings.reference_fingerprint))
    check_same(state.reference_fingerprint, found, f"train.dpo.reference={source!r} is not "
               "the reference this run was trained against", "resume with the same reference")
    return state.replace(reference=reference)
