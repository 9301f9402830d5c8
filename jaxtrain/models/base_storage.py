"""Storage kinds of a LoRA run's frozen base: one registry entry per stored form.

A frozen weight gets no gradient, so it can be held in fewer bits than the float32 master
weights the trained parameters keep: each entry says how a block matmul weight is stored
(quantize), how it is read back in the compute dtype (dequantize, per layer inside the
scan, so that no full-width copy of the model exists at once), what it costs (bytes per
parameter, the planner's fact), and which models it cannot store (its check).

Only the blocks' matmul weights (what LoRA can target: models/lora.py TARGETS) take the
entry's form, as QLoRA quantizes only the linear layers; the embedding table, the output
head and the MoE router are held in `table_dtype`, and vectors (norm scales, biases) stay
float32 (a few thousand values a layer).

Not yet wired into training (TrainState.frozen, train/frozen.py) or the planner: see
docs/finetune.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.models import int8, nf4


def layer_matrix_axes(axes: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(output axes, input axes) of one layer of a stacked matmul weight, as indices into
    its per-layer shape: a torch Linear's [out, in] order."""
    lead = 1 if axes and axes[0] == "layers" else 0
    inputs = tuple(i - lead for i in int8.contraction_axes(axes))
    outputs = tuple(i for i in range(len(axes) - lead) if i not in inputs)
    return outputs, inputs


def _nf4_quantize(w: jax.Array, axes: tuple) -> dict:
    lead = 1 if axes and axes[0] == "layers" else 0
    outputs, inputs = layer_matrix_axes(axes)
    order = tuple(range(lead)) + tuple(i + lead for i in outputs + inputs)
    flat = jnp.transpose(w, order).reshape(*w.shape[:lead], -1)
    return nf4.quantize(flat)


def _nf4_dequantize(stored: dict, dtype, shape: tuple, axes: tuple) -> jax.Array:
    """shape: the weight's per-layer shape; the leading axes are the stored arrays'."""
    outputs, inputs = layer_matrix_axes(axes)
    lead = stored["codes"].shape[:-1]
    flat = nf4.dequantize(stored, dtype)
    w = flat.reshape(*lead, *(shape[i] for i in outputs + inputs))
    order = outputs + inputs
    inverse = tuple(sorted(range(len(order)), key=order.__getitem__))
    return jnp.transpose(w, tuple(range(len(lead))) + tuple(len(lead) + i for i in inverse))


def _nf4_problem(in_dims: dict[str, int]) -> str | None:
    odd = [f"{name} ({dim})" for name, dim in in_dims.items() if dim % nf4.BLOCK]
    if odd:
        return (f"nf4 quantizes each output channel's inputs in blocks of {nf4.BLOCK}: the "
                f"input width of {', '.join(odd)} is not a multiple of {nf4.BLOCK}")
    return None


@dataclasses.dataclass(frozen=True)
class BaseStorage:
    name: str
    doc: str
    # A block matmul weight (float32, its logical axes) -> its stored pytree.
    quantize: Callable[[jax.Array, tuple], Any]
    # (stored, dtype, per-layer shape, logical axes) -> the weight in dtype.
    dequantize: Callable[..., jax.Array]
    # Planner fact: bytes per block matmul weight parameter as stored (scales included).
    matmul_bytes: float
    # The embedding table's, the output head's and the router's dtype.
    table_dtype: Any = jnp.float32
    # (matmul weight name: its per-layer input width) -> why this kind cannot store it.
    check: Callable[[dict[str, int]], str | None] = lambda in_dims: None

    @property
    def table_bytes(self) -> int:
        return jnp.dtype(self.table_dtype).itemsize

    def problem(self, in_dims: dict[str, int]) -> str | None:
        return self.check(in_dims)


def _cast(dtype) -> Callable:
    return lambda w, axes: w.astype(dtype)


def _read(stored, dtype, shape=None, axes=None) -> jax.Array:
    return stored.astype(dtype)


STORAGES: dict[str, BaseStorage] = {s.name: s for s in (
    BaseStorage("float32", "float32, as trained (the default)", lambda w, axes: w, _read,
                matmul_bytes=4),
    BaseStorage("bfloat16", "bfloat16 weights and tables (torchtune's and PEFT's default)",
                _cast(jnp.bfloat16), _read, matmul_bytes=2, table_dtype=jnp.bfloat16),
    BaseStorage("int8", "int8 matmul weights, a float32 absmax per output channel "
                "(models/int8.py); bfloat16 tables", int8.quantize, _read,
                matmul_bytes=1, table_dtype=jnp.bfloat16),
    BaseStorage("nf4", "QLoRA's NF4 matmul weights: blocks of 64, double-quantized absmax "
                "(models/nf4.py); bfloat16 tables", _nf4_quantize, _nf4_dequantize,
                matmul_bytes=nf4.stored_bytes_per_value(), table_dtype=jnp.bfloat16,
                check=_nf4_problem),
)}


def stored_bytes(storage: BaseStorage, w: jax.Array, axes: tuple) -> int:
    """The bytes `storage` holds `w` in (what matmul_bytes approximates), from shapes."""
    stored = jax.eval_shape(lambda x: storage.quantize(x, axes), w)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(stored))
