"""fp8 matmuls with current scaling: e4m3 operands forward, e5m2 gradients backward.

Each operand is scaled so that its largest magnitude lands at the top of the fp8 range
(computed from the tensor itself every call: "current scaling", simpler than Transformer
Engine's delayed amax history and exact in the scale), cast to fp8, multiplied with a
higher-precision accumulator, and unscaled. The backward pass quantizes the incoming
gradient to e5m2 (more range, less precision) the same way. Master weights stay float32:
only the matmul operands are fp8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return (x.astype(jnp.float32) / scale).astype(dtype), scale


def fp8_einsum(equation: str, x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """einsum(equation, x, w) with fp8 operands, the result in out_dtype."""
    return _fp8_einsum(equation, jnp.dtype(out_dtype).name, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_einsum(equation: str, out_dtype: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return _fwd(equation, out_dtype, x, w)[0]


def _fwd(equation, out_dtype, x, w):
    x8, sx = _quantize(x, E4M3)
    w8, sw = _quantize(w, E4M3)
    y = jnp.einsum(equation, x8, w8, preferred_element_type=jnp.float32)
    # Empty arrays carry the operands' dtypes into the backward pass.
    dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return (y * (sx * sw)).astype(out_dtype), (x8, sx, w8, sw, dtypes)


def _bwd(equation, out_dtype, residuals, g):
    x8, sx, w8, sw, (x_like, w_like) = residuals
    x_dtype, w_dtype = x_like.dtype, w_like.dtype
    g8, sg = _quantize(g, E5M2)
    inputs, output = equation.split("->")
    x_spec, w_spec = inputs.split(",")
    # dx = g · wᵀ and dw = xᵀ · g, as einsums over the same index letters.
    dx = jnp.einsum(f"{output},{w_spec}->{x_spec}", g8, w8, preferred_element_type=jnp.float32)
    dw = jnp.einsum(f"{x_spec},{output}->{w_spec}", x8, g8, preferred_element_type=jnp.float32)
    return (dx * (sg * sw)).astype(x_dtype), (dw * (sx * sg)).astype(w_dtype)


_fp8_einsum.defvjp(_fwd, _bwd)
