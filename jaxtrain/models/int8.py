"""INT8 weights for serving: per-output-channel scales, optionally int8 activations.

An `Int8Weight` takes the place of a float weight in the parameter tree. Reading it as a
float (`.astype`, `.T`) dequantizes inside the jitted function, so every model path works
unchanged; `layers.dense` instead runs an int8 × int8 matmul with int32 accumulation when the
weight carries calibrated activation scales (`int8_activations`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxtrain.models.layers import MatmulWeight


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight(MatmulWeight):
    values: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32, the weight's shape with 1 on the contraction axes
    act_scale: jax.Array  # float32, [] per layer: the input's calibrated absmax / 127
    int8_activations: bool = dataclasses.field(default=False, metadata={"static": True})

    def __getitem__(self, index):
        assert index is Ellipsis, index  # params are read whole: `param[...]`
        return self

    def astype(self, dtype) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scale).astype(dtype)

    @property
    def T(self) -> jax.Array:  # noqa: N802 - the array attribute it stands in for
        return self.astype(jnp.float32).T

    def einsum(self, equation: str, x: jax.Array, dtype) -> jax.Array:
        if self.int8_activations:
            return int8_einsum(equation, x, self, dtype)
        return jnp.einsum(equation, x, self.astype(dtype))


def contraction_axes(axes: tuple) -> tuple[int, ...]:
    """Which axes of a weight a matmul contracts, from its logical axes: `embed`, unless
    the weight writes embed (its last axis), then all the others. Leading `layers` axes are
    never contracted (they are scanned)."""
    if axes[-1] == "embed":
        return tuple(i for i, a in enumerate(axes[:-1]) if a != "layers")
    return tuple(i for i, a in enumerate(axes) if a == "embed")


def quantize(w: jax.Array, axes: tuple) -> Int8Weight:
    """Symmetric per-output-channel int8: scale = absmax over the contraction axes / 127."""
    w = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=contraction_axes(axes), keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    layers = w.shape[:1] if axes[0] == "layers" else ()
    return Int8Weight(values, scale, jnp.ones(layers, jnp.float32))


def int8_einsum(equation: str, x: jax.Array, w: Int8Weight, out_dtype) -> jax.Array:
    """x quantized with its calibrated per-tensor scale, int8 × int8 → int32, rescaled."""
    x_q = jnp.clip(jnp.round(x.astype(jnp.float32) / w.act_scale), -127, 127).astype(jnp.int8)
    y = jnp.einsum(equation, x_q, w.values, preferred_element_type=jnp.int32)
    inputs, output = equation.split("->")
    w_letters = inputs.split(",")[1]
    # The weight's output channels, in the order they appear in the result.
    kept = [c for c in w_letters if c in output]
    scale = jnp.squeeze(w.scale, axis=tuple(i for i, c in enumerate(w_letters)
                                            if c not in output))
    scale = jnp.transpose(scale, [kept.index(c) for c in output if c in kept])
    return (y.astype(jnp.float32) * w.act_scale * scale).astype(out_dtype)
