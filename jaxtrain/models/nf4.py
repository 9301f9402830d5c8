"""NF4 with double-quantized absmax (QLoRA, Dettmers et al. 2023), as bitsandbytes stores it.

One matrix [out, in] (a torch Linear's layout: each output channel's inputs contiguous) is
flattened and cut into blocks of 64; a block keeps its absmax and, per value, the index of
the nearest of NF4's 16 levels to value/absmax (two indices a byte, the first in the high
nibble). The absmax values, less their mean, are quantized again to 8 bits in blocks of 256
with bitsandbytes' dynamic (signed, 7 exponent bits) code and a float32 absmax per block.
The same numbers as `bitsandbytes.functional.quantize_4bit(A, blocksize=64,
quant_type="nf4", compress_statistics=True)` and `dequantize_4bit`
(tests/parity/test_base_storage.py).
Every function takes leading (stacked-layer) axes in front of the flat matrix: each layer is
quantized on its own, as each Linear is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64  # values per absmax
ABSMAX_BLOCK = 256  # absmax values per float32 scale (the double quantization)

# bitsandbytes' NF4 levels (the paper's Appendix E, normalised to [-1, 1]).
NF4_LEVELS = np.asarray([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)


def _linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in float32 (its CPU kernel): a float32 step, each value one fused
    multiply-add (exact product, one rounding) from the start for the first half and from
    the end for the rest."""
    step = np.float64(np.float32((np.float32(end) - np.float32(start)) / np.float32(steps - 1)))
    i = np.arange(steps)
    low = (np.float64(np.float32(start)) + step * i).astype(np.float32)
    high = (np.float64(np.float32(end)) - step * (steps - i - 1)).astype(np.float32)
    return np.where(i < steps // 2, low, high)


def dynamic_levels() -> np.ndarray:
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): 256
    float32 levels, sorted, for the 8-bit absmax."""
    data = []
    for i in range(7):
        bounds = _linspace_f32(0.1, 1, 2 ** i + 1)
        means = ((bounds[:-1] + bounds[1:]) / np.float32(2)).astype(np.float32)
        scaled = (np.float32(10.0 ** (-6 + i)) * means).astype(np.float32)
        data += list(scaled) + list(-scaled)
    data += [np.float32(0), np.float32(1)]
    data += [np.float32(0)] * (256 - len(data))
    return np.sort(np.asarray(data, np.float32))


DYNAMIC_LEVELS = dynamic_levels()


def _blockwise(x_NK: jax.Array, levels: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(nearest level's index, uint8 [.., N, K]; absmax [.., N]) of blocks x [.., N, K], as
    bitsandbytes: value·(1/absmax) clamped to [-1, 1], the first nearest level."""
    absmax_N = jnp.max(jnp.abs(x_NK), axis=-1)
    safe_N = jnp.where(absmax_N > 0, absmax_N, 1.0)
    scaled = jnp.clip(x_NK * (1 / safe_N)[..., None], -1, 1)
    index = jnp.argmin(jnp.abs(scaled[..., None] - jnp.asarray(levels)), axis=-1)
    return index.astype(jnp.uint8), absmax_N


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """[.., n] -> [.., ceil(n/size), size], the last block padded with zeros (which change
    neither its absmax nor, being cut off again, the values)."""
    n = x.shape[-1]
    pad = -n % size
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], (n + pad) // size, size)


def quantize(x: jax.Array) -> dict:
    """The stored form of flat float matrices x [.., n] (n a multiple of 2):
    {codes uint8 [.., n/2], absmax uint8 [.., n/64], absmax_scale float32 [.., n/64/256],
    absmax_offset float32 [..]}."""
    x = x.astype(jnp.float32)
    n = x.shape[-1]
    index, absmax = _blockwise(_blocks(x, BLOCK), NF4_LEVELS)
    index = index.reshape(*x.shape[:-1], -1)[..., :n]
    codes = (index[..., 0::2] << 4) | index[..., 1::2]
    return {"codes": codes, **double_quantize(absmax, jnp.mean(_whole(absmax), axis=-1))}


def _whole(x: jax.Array) -> jax.Array:
    """x replicated on the devices of the mesh in context (none: x itself), so that a float
    sum over it adds in one device's order on every mesh: split over fsdp=2 the mean of the
    absmax moved by its last bit, and with it the 8-bit absmax codes, so that the same base
    stored on another mesh had another fingerprint (a resume or export on it was refused).
    The absmax is 1/64 of the values: gathering it costs little."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())


def double_quantize(absmax: jax.Array, offset: jax.Array) -> dict:
    """The 8-bit form of float32 absmax values [.., m] less their mean `offset` [..]
    (torch's float32 mean sums in another order: the offset can differ in its last bit)."""
    m = absmax.shape[-1]
    q, scale = _blockwise(_blocks(absmax - offset[..., None], ABSMAX_BLOCK), DYNAMIC_LEVELS)
    return {"absmax": q.reshape(*q.shape[:-2], -1)[..., :m], "absmax_scale": scale,
            "absmax_offset": offset}


def absmax_of(stored: dict) -> jax.Array:
    """The float32 absmax per block of 64 [.., n/64], from its 8-bit form."""
    q = stored["absmax"]
    m = q.shape[-1]
    levels = jnp.asarray(DYNAMIC_LEVELS)[_blocks(q, ABSMAX_BLOCK).astype(jnp.int32)]
    values = (levels * stored["absmax_scale"][..., None]).reshape(*q.shape[:-1], -1)[..., :m]
    return values + stored["absmax_offset"][..., None]


def dequantize(stored: dict, dtype) -> jax.Array:
    """The flat matrices [.., n] in `dtype` (computed in float32, as bitsandbytes does for a
    float32 source)."""
    codes = stored["codes"]
    index = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*codes.shape[:-1], -1)
    values = jnp.asarray(NF4_LEVELS)[index.astype(jnp.int32)]
    n = values.shape[-1]
    blocks = _blocks(values, BLOCK) * absmax_of(stored)[..., None]
    return blocks.reshape(*codes.shape[:-1], -1)[..., :n].astype(dtype)


def stored_bytes_per_value() -> float:
    """Bytes per weight value: 4 bits, an 8-bit absmax per 64, a float32 scale per 64·256."""
    return 0.5 + 1 / BLOCK + 4 / (BLOCK * ABSMAX_BLOCK)
