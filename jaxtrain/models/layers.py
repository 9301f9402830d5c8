"""Small building blocks: parameters with logical axes, norms, GELU; rotary embeddings are
models/rope.py's (re-exported here)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.fp8 import fp8_einsum
from jaxtrain.models.rope import rope  # noqa: F401 - re-exported


def param(rngs: nnx.Rngs, shape, axes, std: float | None, dtype) -> nnx.Param:
    """A parameter tagged with its logical axes; std None means ones, 0.0 means zeros."""
    assert len(shape) == len(axes), (shape, axes)
    if std is None:
        value = jnp.ones(shape, dtype)
    elif std == 0.0:
        value = jnp.zeros(shape, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, axes=tuple(axes))


class Norm(nnx.Module):
    """LayerNorm (GPT-2: centred, with bias) or RMSNorm (Llama), statistics in float32."""

    def __init__(self, dim: int, *, rms: bool, eps: float, dtype, rngs: nnx.Rngs,
                 offset: float = 0.0):
        """offset: the scale applied is offset + the stored weight (1 + w, the weight
        born zero); 0: the weight itself."""
        self.rms, self.eps, self.offset = rms, eps, offset
        self.scale = param(rngs, (dim,), ("embed",), 0.0 if offset else None, dtype)
        self.bias = None if rms else param(rngs, (dim,), ("embed",), 0.0, dtype)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        scale = self.offset + self.scale[...] if self.offset else self.scale[...]
        return _norm(x_BLD, scale, bias, self.rms, self.eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis (any leading axes: the per-head q/k norm's [B, L, H, K])."""
    return _norm(x, scale, None, True, eps)


def _normalize(x, scale, bias, rms: bool, eps: float):
    """(output in x's dtype, normalized x in float32, 1/std)."""
    xf = x.astype(jnp.float32)
    if not rms:
        xf = xf - xf.mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps)
    x_hat = xf * rstd
    y = x_hat * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), x_hat, rstd


# By hand rather than by autodiff, which keeps three full-size tensors per norm for the
# backward pass (centred x, normalized x, and the output) where the closed form needs one
# (normalized x) and 1/std: with two norms per layer that is ≈10% of the step's saved
# activations, and the backward is one fused pass (configs/bench_cpu.py: 6% off the step).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x, scale, bias, rms: bool, eps: float):
    return _normalize(x, scale, bias, rms, eps)[0]


def _norm_fwd(x, scale, bias, rms, eps):
    y, x_hat, rstd = _normalize(x, scale, bias, rms, eps)
    return y, (x_hat, rstd, scale, bias)


def _norm_bwd(rms, eps, residuals, dy):
    x_hat, rstd, scale, bias = residuals
    g = dy.astype(jnp.float32)
    rows = tuple(range(g.ndim - 1))
    dscale = (g * x_hat).sum(rows).astype(scale.dtype)
    dbias = None if bias is None else g.sum(rows).astype(bias.dtype)
    dx_hat = g * scale
    dx = dx_hat - x_hat * (dx_hat * x_hat).mean(-1, keepdims=True)
    if not rms:
        dx = dx - dx_hat.mean(-1, keepdims=True)
    return (rstd * dx).astype(dy.dtype), dscale, dbias


_norm.defvjp(_norm_fwd, _norm_bwd)


_GELU_C = math.sqrt(2 / math.pi)


# tanh-GELU (GPT-2's "gelu_new", jax.nn.gelu's default) with a closed-form derivative: the
# backward is one fused pass over the input, where autodiff keeps tanh's output as an extra
# full-size tensor and reads it from two more passes (configs/bench_cpu.py: −1.8% step time).
@jax.custom_vjp
def gelu(u: jax.Array) -> jax.Array:
    return jax.nn.gelu(u, approximate=True)


def _gelu_fwd(u):
    return gelu(u), u


def _gelu_bwd(u, g):
    uf = u.astype(jnp.float32)
    inner = _GELU_C * (uf + 0.044715 * uf * uf * uf)
    t = jnp.tanh(inner)
    slope = 0.5 * (1 + t) + 0.5 * uf * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * uf * uf)
    return ((g * slope).astype(g.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


class MatmulWeight:
    """A stand-in for a weight array that runs its own matmul (int8 serving weights,
    models/int8.py; quantization's calibration probes)."""

    def einsum(self, equation: str, x: jax.Array, dtype) -> jax.Array:
        raise NotImplementedError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRank:
    """A weight with a low-rank adapter (LoRA, models/lora.py): w + scale·(a @ b), run as
    x@w + scale·(x@a)@b so that the frozen w gets no gradient. a: w's input axes then the
    rank; b: the rank then w's output axes."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata=dict(static=True))


def _low_rank_equations(equation: str) -> tuple[str, str]:
    """'bl<in>,<in><out>->bl<out>' -> (x@a: 'bl<in>,<in>z->blz', then 'blz,z<out>->bl<out>')."""
    inputs, out = equation.split("->")
    x_axes, w_axes = inputs.split(",")
    contracted = _split_weight_axes(equation)
    return (f"{x_axes},{w_axes[:contracted]}z->{x_axes[:2]}z",
            f"{x_axes[:2]}z,z{w_axes[contracted:]}->{out}")


def dense(spec, equation: str, x: jax.Array, w) -> jax.Array:
    """A weight matmul in the spec's precision: compute dtype, or fp8 operands; weights that
    bring their own matmul (MatmulWeight) run it; a LowRank weight adds its adapter's
    product, its factors cast and multiplied like the weight."""
    if isinstance(w, LowRank):
        to_rank, from_rank = _low_rank_equations(equation)
        low_BLR = dense(spec, to_rank, x, w.a)
        update = dense(spec, from_rank, low_BLR, w.b)
        return dense(spec, equation, x, w.w) + jnp.asarray(w.scale, update.dtype) * update
    if isinstance(w, MatmulWeight):
        return w.einsum(equation, x, spec.compute_dtype)
    if spec.fp8:
        return fp8_einsum(equation, x, w, spec.compute_dtype)
    if getattr(spec, "context", None) is not None:
        # The sequence is sharded (context parallelism): flattening [B, L] into one token
        # axis would merge a replicated and a sharded dimension, which XLA can only do by
        # all-gathering the activations; the einsum keeps both axes.
        return jnp.einsum(equation, x, w.astype(spec.compute_dtype))
    return _weight_matmul(x, w.astype(spec.compute_dtype), equation)


def _split_weight_axes(equation: str) -> int:
    """How many leading weight axes `equation` contracts; it must read 'bl<in>,<in><out>->
    bl<out>' (all the model's weight matmuls do)."""
    inputs, out = equation.split("->")
    x_axes, w_axes = inputs.split(",")
    contracted = x_axes[2:]
    assert w_axes.startswith(contracted) and out == x_axes[:2] + w_axes[len(contracted):], \
        equation
    return len(contracted)


# As one [tokens, in] × [in, out] matmul, with the weight gradient formed as dyᵀx and then
# transposed: XLA:CPU otherwise lays autodiff's weight gradient out as a transposed-operands
# dot that its fast matmul library does not take, and falls back to a generic one at half
# the speed (configs/bench_cpu.py: the MLP's forward+backward 2× faster, see
# docs/benchmarks.md). The numbers are the same matmuls, in the same float32 accumulation.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _weight_matmul(x: jax.Array, w: jax.Array, equation: str) -> jax.Array:
    contracted = _split_weight_axes(equation)
    d_in = math.prod(w.shape[:contracted])
    y2 = x.reshape(-1, d_in) @ w.reshape(d_in, -1)
    return y2.reshape(*x.shape[:2], *w.shape[contracted:])


def _weight_matmul_fwd(x, w, equation):
    return _weight_matmul(x, w, equation), (x, w)


def _weight_matmul_bwd(equation, residuals, dy):
    x, w = residuals
    d_in = math.prod(w.shape[:_split_weight_axes(equation)])
    x2, w2 = x.reshape(-1, d_in), w.reshape(d_in, -1)
    dy2 = dy.reshape(x2.shape[0], -1)
    dx = (dy2 @ w2.T).reshape(x.shape)
    dw = jax.lax.dot_general(dy2, x2, (((0,), (0,)), ((), ()))).T.reshape(w.shape)
    return dx, dw


_weight_matmul.defvjp(_weight_matmul_fwd, _weight_matmul_bwd)
