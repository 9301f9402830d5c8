"""Optimizer state offloaded to pinned host memory trains exactly as on the device."""

import jax
import numpy as np
import pytest
from conftest import small_config
from helpers import train_steps

from jaxtrain.optim import adam_moments


@pytest.mark.slow
def test_offloaded_adam_moments_live_on_the_host_and_change_nothing(devices):
    base = {"mesh.data": 1, "mesh.fsdp": 2}
    ref_losses, ref_params, _ = train_steps(small_config(**base), devices[:2])
    losses, params, state = train_steps(
        small_config(**base, **{"optimizer.offload_to_host": True}), devices[:2])
    assert losses == ref_losses
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_array_equal(a, b)
    mu, nu = adam_moments(state.opt_state)
    for moment in jax.tree.leaves(mu) + jax.tree.leaves(nu):
        assert moment.sharding.memory_kind == "pinned_host"
    for param in jax.tree.leaves(state.params):
        assert param.sharding.memory_kind == "device"
