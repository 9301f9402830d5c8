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

`model.lora.base_dtype` names the entry. The stored base is what TrainState.frozen holds
(train/frozen.py stores it once, as it loads); an NF4 or int8 weight is a MatmulWeight that
the layers read as they read an array, and the layer scan (models/stack.py) slices its
stored arrays per layer, so it is dequantized one layer at a time in the compute dtype.
The planner counts the base from matmul_bytes and table_bytes (plan/memory.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxtrain.errors import fail
from jaxtrain.models import int8, nf4
from jaxtrain.models.layers import MatmulWeight

# The blocks' matmul weights a storage kind holds in its form (what LoRA can target).
MATMULS = ("w_q", "w_k", "w_v", "w_o", "w_up", "w_gate", "w_down")
# The layer stacks (models/transformer.py) whose matmul weights take the kind's form.
STACKS = ("blocks", "moe_blocks")


def layer_matrix_axes(axes: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(output axes, input axes) of one layer of a stacked matmul weight, as indices into
    its per-layer shape: a torch Linear's [out, in] order."""
    lead = 1 if axes and axes[0] == "layers" else 0
    inputs = tuple(i - lead for i in int8.contraction_axes(axes))
    outputs = tuple(i for i in range(len(axes) - lead) if i not in inputs)
    return outputs, inputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NF4Weight(MatmulWeight):
    """A stacked matmul weight in NF4 (models/nf4.py), each layer's matrix flattened in a
    torch Linear's [out, in] order; read as an array it is dequantized (in float32, as
    bitsandbytes does, then cast). Its arrays keep any leading (layer, group) axes, which
    the scan slices away: inside it, one layer is dequantized at a time."""

    codes: jax.Array  # uint8 [.., n/2]
    absmax: jax.Array  # uint8 [.., n/64]
    absmax_scale: jax.Array  # float32 [.., n/64/256]
    absmax_offset: jax.Array  # float32 [..]
    layer_shape: tuple = dataclasses.field(metadata={"static": True})
    axes: tuple = dataclasses.field(metadata={"static": True})  # the weight's, "layers" first

    def __getitem__(self, index):
        assert index is Ellipsis, index  # params are read whole: `param[...]`
        return self

    @property
    def shape(self) -> tuple:
        return (*self.codes.shape[:-1], *self.layer_shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)  # what it reads back as (lora.merged keeps it)

    def astype(self, dtype) -> jax.Array:
        stored = {f: getattr(self, f) for f in ("codes", "absmax", "absmax_scale",
                                                "absmax_offset")}
        return _nf4_dequantize(stored, dtype, self.layer_shape, self.axes)

    @property
    def T(self) -> jax.Array:  # noqa: N802 - the array attribute it stands in for
        return self.astype(jnp.float32).T

    def einsum(self, equation: str, x: jax.Array, dtype) -> jax.Array:
        return jnp.einsum(equation, x, self.astype(dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BF16Weight(MatmulWeight):
    """A bfloat16 matmul weight held as its 16 bits (uint16), read back as bfloat16 and cast.
    As a bfloat16 array XLA:CPU, which has no bfloat16 arithmetic, turns the whole stacked
    weight into a float32 copy before the layer loop (an 8B step compiled 35 GB of
    temporaries, plan --compile); its bits are sliced per layer like NF4's codes."""

    bits: jax.Array  # uint16, the weight's shape

    def __getitem__(self, index):
        assert index is Ellipsis, index  # params are read whole: `param[...]`
        return self

    @property
    def shape(self) -> tuple:
        return self.bits.shape

    @property
    def ndim(self) -> int:
        return self.bits.ndim

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)

    def astype(self, dtype) -> jax.Array:
        return jax.lax.bitcast_convert_type(self.bits, jnp.bfloat16).astype(dtype)

    @property
    def T(self) -> jax.Array:  # noqa: N802 - the array attribute it stands in for
        return self.astype(jnp.float32).T

    def einsum(self, equation: str, x: jax.Array, dtype) -> jax.Array:
        return jnp.einsum(equation, x, self.astype(dtype))


def _bf16_quantize(w: jax.Array, axes: tuple) -> BF16Weight:
    return BF16Weight(jax.lax.bitcast_convert_type(w.astype(jnp.bfloat16), jnp.uint16))


def _nf4_quantize(w: jax.Array, axes: tuple) -> NF4Weight:
    lead = 1 if axes and axes[0] == "layers" else 0
    outputs, inputs = layer_matrix_axes(axes)
    order = tuple(range(lead)) + tuple(i + lead for i in outputs + inputs)
    flat = jnp.transpose(w, order).reshape(*w.shape[:lead], -1)
    return NF4Weight(**nf4.quantize(flat), layer_shape=tuple(w.shape[lead:]), axes=tuple(axes))


def _nf4_dequantize(stored, dtype, shape: tuple, axes: tuple) -> jax.Array:
    """shape: the weight's per-layer shape; the leading axes are the stored arrays'."""
    if isinstance(stored, NF4Weight):
        return stored.astype(dtype)
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


def _read(stored, dtype, shape=None, axes=None) -> jax.Array:
    return stored.astype(dtype)


STORAGES: dict[str, BaseStorage] = {s.name: s for s in (
    BaseStorage("float32", "float32, as trained (the default)", lambda w, axes: w, _read,
                matmul_bytes=4),
    BaseStorage("bfloat16", "bfloat16 weights and tables (torchtune's and PEFT's default)",
                _bf16_quantize, _read, matmul_bytes=2, table_dtype=jnp.bfloat16),
    BaseStorage("int8", "int8 matmul weights, a float32 absmax per output channel "
                "(models/int8.py); bfloat16 tables", int8.quantize, _read,
                matmul_bytes=1, table_dtype=jnp.bfloat16),
    BaseStorage("nf4", "QLoRA's NF4 matmul weights: blocks of 64, double-quantized absmax "
                "(models/nf4.py); bfloat16 tables", _nf4_quantize, _nf4_dequantize,
                matmul_bytes=nf4.stored_bytes_per_value(), table_dtype=jnp.bfloat16,
                check=_nf4_problem),
)}


def check(kind: str, in_dims: dict[str, int]) -> None:
    """ConfigError (one line) for a `model.lora.base_dtype` that is no entry or cannot
    store this model (in_dims: matmul weight name -> its input width)."""
    if kind not in STORAGES:
        fail("model.lora.base_dtype", kind, f"one of {', '.join(STORAGES)}")
    if problem := STORAGES[kind].problem(in_dims):
        fail("model.lora.base_dtype", kind, problem)


def role(path: tuple, shape: tuple, axes: tuple) -> str:
    """How a frozen base parameter is stored: 'matmul' (the entry's form), 'table' (in
    table_dtype: the embedding, output head, router and any other per-layer matrix) or
    'vector' (float32: norm scales, biases)."""
    per_layer = len(shape) - (1 if axes and axes[0] == "layers" else 0)
    if path[0] in STACKS and path[-1] in MATMULS:
        return "matmul"
    return "table" if per_layer >= 2 else "vector"


def store(storage: BaseStorage, base: dict, axes_by_path: dict) -> dict:
    """The frozen base parameters in `storage`'s form (float32: `base` itself, bitwise)."""
    if storage.name == "float32":
        return base
    flat = traverse_util.flatten_dict(base)
    for path, w in flat.items():
        kind = role(path, w.shape, axes_by_path[path])
        if kind == "matmul":
            flat[path] = storage.quantize(w, axes_by_path[path])
        elif kind == "table":
            flat[path] = w.astype(storage.table_dtype)
    return traverse_util.unflatten_dict(flat)


def stored_shardings(storage: BaseStorage, shapes: dict, shardings: dict,
                     axes_by_path: dict) -> dict:
    """Shardings of store()'s tree: a stored array of the weight's rank keeps the weight's
    split on the dimensions it keeps whole (int8's scales lose the contracted ones); a
    flattened one (NF4's) keeps the split of its leading stacked axis only."""
    stored = jax.eval_shape(lambda b: store(storage, b, axes_by_path), shapes)
    flat_shapes = traverse_util.flatten_dict(shapes)
    flat_shardings = traverse_util.flatten_dict(shardings)
    flat_stored = traverse_util.flatten_dict(stored, is_leaf=lambda _, x: not isinstance(x, dict))
    out = {}
    for path, leaf in flat_stored.items():
        sharding, shape = flat_shardings[path], flat_shapes[path].shape
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))

        def like(x, spec=spec, shape=shape, sharding=sharding):
            if x.ndim == len(shape):
                kept = [a if n == m else None for a, n, m in zip(spec, x.shape, shape)]
            else:
                stacked = x.ndim and axes_by_path[path][0] == "layers" and x.shape[0] == shape[0]
                kept = [spec[0] if stacked else None] + [None] * (x.ndim - 1)
            return jax.sharding.NamedSharding(sharding.mesh,
                                              jax.sharding.PartitionSpec(*kept[:x.ndim]))

        out[path] = jax.tree.map(like, leaf)
    return traverse_util.unflatten_dict(out)


def stored_bytes(storage: BaseStorage, w: jax.Array, axes: tuple) -> int:
    """The bytes `storage` holds `w` in (what matmul_bytes approximates), from shapes."""
    stored = jax.eval_shape(lambda x: storage.quantize(x, axes), w)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(stored))
