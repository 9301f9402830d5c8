"""Frozen-base storage kinds (models/base_storage.py, models/nf4.py): NF4 against
bitsandbytes and a float64 numpy reference, the stacked layout, the bytes facts, the checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models import nf4
from jaxtrain.models.base_storage import STORAGES, stored_bytes

# The paper's NF4 levels (Dettmers et al. 2023, Appendix E), independent of models/nf4.py.
PAPER_NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                      -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                      0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                      0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                      0.7229568362236023, 1.0])


def _weight(shape, seed=0):
    return (0.02 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _bnb(w_OI):
    """bitsandbytes' NF4 (blocks of 64, double-quantized absmax) of a [out, in] matrix."""
    # In the test extra: a missing bitsandbytes fails here rather than skipping.
    import torch
    from bitsandbytes import functional
    packed, state = functional.quantize_4bit(torch.from_numpy(w_OI), blocksize=64,
                                             quant_type="nf4", compress_statistics=True)
    return functional, packed, state


def test_nf4_equals_bitsandbytes_quantize_and_dequantize_4bit():
    w = _weight((96, 640))  # 960 absmax values: the last block of 256 is partial
    functional, packed, state = _bnb(w)
    ours = nf4.quantize(jnp.asarray(w.reshape(-1)))
    np.testing.assert_array_equal(nf4.DYNAMIC_LEVELS, functional.create_dynamic_map(True))
    np.testing.assert_array_equal(np.asarray(ours["codes"]), packed.numpy().reshape(-1))
    # torch's float32 mean sums in another order (the last bit); from its offset on, equal.
    np.testing.assert_allclose(float(ours["absmax_offset"]), float(state.offset), rtol=1e-6)
    absmax = jnp.asarray(np.abs(w.reshape(-1, 64)).max(-1))
    theirs = nf4.double_quantize(absmax, jnp.asarray(float(state.offset), jnp.float32))
    # bitsandbytes' CPU kernel rounds a few values at a level boundary the other way.
    off = np.asarray(theirs["absmax"]).astype(int) - state.absmax.numpy().astype(int)
    assert np.abs(off).max() <= 1 and (off != 0).mean() < 0.005, off
    np.testing.assert_array_equal(np.asarray(theirs["absmax_scale"]),
                                  state.state2.absmax.numpy())
    # Their stored state read back by our dequantize: their dequantize_4bit.
    stored = {"codes": ours["codes"], "absmax": jnp.asarray(state.absmax.numpy()),
              "absmax_scale": jnp.asarray(state.state2.absmax.numpy()),
              "absmax_offset": jnp.asarray(float(state.offset), jnp.float32)}
    reference = functional.dequantize_4bit(packed, state).numpy().reshape(-1)
    np.testing.assert_allclose(np.asarray(nf4.dequantize(stored, jnp.float32)), reference,
                               rtol=1e-6, atol=1e-9)
    mine = np.asarray(nf4.dequantize(ours, jnp.float32))
    error, their_error = np.abs(mine - w.reshape(-1)).max(), np.abs(reference - w.reshape(-1)).max()
    assert error <= 1.01 * their_error, (error, their_error)


def test_nf4_equals_a_float64_reference_of_the_papers_levels_and_blocks():
    w = _weight((64, 256), seed=1).reshape(-1)
    blocks = w.astype(np.float64).reshape(-1, 64)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    nearest = np.abs((blocks / absmax)[..., None] - PAPER_NF4).argmin(-1).reshape(-1)
    ours = nf4.quantize(jnp.asarray(w))
    codes = np.asarray(ours["codes"])
    np.testing.assert_array_equal(np.stack([codes >> 4, codes & 15], -1).reshape(-1), nearest)
    np.testing.assert_allclose(np.asarray(nf4.absmax_of(ours)), absmax[:, 0], rtol=0.01)
    reference = (PAPER_NF4[nearest].reshape(-1, 64) * absmax).reshape(-1)
    np.testing.assert_allclose(np.asarray(nf4.dequantize(ours, jnp.float32)), reference,
                               rtol=0, atol=0.01 * absmax.max())


@pytest.mark.parametrize("shape,axes,out_in", [
    ((2, 128, 4, 16), ("layers", "embed", "heads", "head_dim"), lambda w: w.reshape(128, 64).T),
    ((2, 4, 16, 128), ("layers", "heads", "head_dim", "embed"), lambda w: w.reshape(64, 128).T),
], ids=["w_q", "w_o"])
def test_a_stacked_weight_is_quantized_layer_by_layer_as_each_linear(shape, axes, out_in):
    w = _weight(shape, seed=2)
    nf4_kind = STORAGES["nf4"]
    stored = nf4_kind.quantize(jnp.asarray(w), axes)
    back = np.asarray(nf4_kind.dequantize(stored, jnp.float32, shape[1:], axes))
    assert back.shape == w.shape
    for layer in range(shape[0]):
        linear = np.ascontiguousarray(out_in(w[layer]))  # torch's [out, in]
        functional, packed, state = _bnb(linear)
        np.testing.assert_array_equal(np.asarray(stored.codes[layer]),
                                      packed.numpy().reshape(-1))
        theirs = functional.dequantize_4bit(packed, state).numpy()
        np.testing.assert_allclose(out_in(back[layer]), theirs, rtol=0, atol=1e-4 * 0.02)


def test_every_kind_states_its_bytes_and_reads_back_its_weight():
    shape, axes = (2, 256, 512), ("layers", "embed", "mlp")
    w = jnp.asarray(_weight(shape, seed=3))
    for kind in STORAGES.values():
        bytes_per = stored_bytes(kind, jax.ShapeDtypeStruct(shape, jnp.float32), axes) / w.size
        assert abs(bytes_per / kind.matmul_bytes - 1) < 0.02, (kind.name, bytes_per)
        back = np.asarray(kind.dequantize(kind.quantize(w, axes), jnp.float32, shape[1:], axes))
        # Per output channel the error is within half a level of its absmax.
        channel_absmax = np.abs(np.asarray(w)).max(axis=1, keepdims=True)
        step = {"float32": 0, "bfloat16": 2 ** -8, "int8": 1 / 127, "nf4": 0.17}[kind.name]
        assert (np.abs(back - np.asarray(w)) <= step * channel_absmax + 1e-12).all(), kind.name
    assert STORAGES["float32"].quantize(w, axes) is w  # bitwise today's base
    assert STORAGES["nf4"].matmul_bytes < 0.52 and STORAGES["bfloat16"].table_bytes == 2


def test_nf4_refuses_an_input_width_off_its_blocks_in_one_line():
    assert STORAGES["nf4"].problem({"w_q": 128, "w_down": 128}) is None
    problem = STORAGES["nf4"].problem({"w_q": 128, "w_down": 96})
    assert "w_down (96)" in problem and "multiple of 64" in problem and "\n" not in problem
    assert STORAGES["int8"].problem({"w_down": 96}) is None
