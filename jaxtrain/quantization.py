"""INT8 quantization of a parameter tree: which weights, their checkpoint form, and the
calibration of activation scales (the command line is jaxtrain/commands/quantize.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import storage
from jaxtrain.data.batches import to_global
from jaxtrain.models.int8 import Int8Weight, contraction_axes, quantize
from jaxtrain.models.layers import MatmulWeight

# Matmul weights and the embedding table; the rest is small and stays float32.
QUANTIZED = ("w_q", "w_k", "w_v", "w_o", "w_up", "w_gate", "w_down", "tok_embed", "lm_head")
_FIELDS = ("values", "scale", "act_scale")


def quantized_paths(axes_by_path: dict) -> list[tuple]:
    return [path for path in axes_by_path if path[-1] in QUANTIZED]


def quantize_params(params: dict, axes_by_path: dict, act_absmax: dict | None) -> dict:
    """The parameter tree with Int8Weight leaves; act_absmax: {path: [layers] absmax of the
    matmul's input} for int8 activations, None for weights only."""
    flat = traverse_util.flatten_dict(params)
    for path in quantized_paths(axes_by_path):
        weight = quantize(flat[path], axes_by_path[path])
        if act_absmax is not None and path in act_absmax:
            weight = dataclasses.replace(
                weight, act_scale=jnp.maximum(act_absmax[path], 1e-8) / 127.0,
                int8_activations=True)
        flat[path] = weight
    return traverse_util.unflatten_dict(flat)


def as_dicts(params: dict) -> dict:
    """Int8Weight leaves as plain {values, scale, act_scale} dicts, for orbax."""
    return jax.tree.map(lambda w: {f: getattr(w, f) for f in _FIELDS}
                        if isinstance(w, Int8Weight) else w, params,
                        is_leaf=lambda x: isinstance(x, Int8Weight))


def from_dicts(params: dict, int8_activations: bool, paths: list[tuple]) -> dict:
    flat = traverse_util.flatten_dict(params)
    for path in paths:
        fields = {f: flat.pop(path + (f,)) for f in _FIELDS}
        # Only the blocks' matmuls (stacked, one activation scale per layer) take int8 inputs.
        flat[path] = Int8Weight(**fields, int8_activations=int8_activations
                                and fields["act_scale"].ndim > 0)
    return traverse_util.unflatten_dict(flat)


def abstract_quantized(target: dict, axes_by_path: dict) -> dict:
    """Shapes and shardings to restore a quantized tree into (scales replicated along the
    contracted axes, which they lack)."""
    flat = traverse_util.flatten_dict(target)
    for path in quantized_paths(axes_by_path):
        w, axes = flat.pop(path), axes_by_path[path]
        reduced = contraction_axes(axes)
        spec = tuple(w.sharding.spec) + (None,) * (w.ndim - len(w.sharding.spec))
        scale_spec = P(*[None if i in reduced else a for i, a in enumerate(spec)])
        layers = w.shape[:1] if axes[0] == "layers" else ()

        def abstract(shape, dtype, spec):
            return jax.ShapeDtypeStruct(shape, dtype,
                                        sharding=NamedSharding(w.sharding.mesh, spec))

        flat[path + ("values",)] = abstract(w.shape, jnp.int8, w.sharding.spec)
        flat[path + ("scale",)] = abstract(
            tuple(1 if i in reduced else n for i, n in enumerate(w.shape)), jnp.float32,
            scale_spec)
        flat[path + ("act_scale",)] = abstract(layers, jnp.float32, P(*[None] * len(layers)))
    return traverse_util.unflatten_dict(flat)


class _AbsMax(dict):
    """{(path, layer): absmax of the input}; hashed by identity, as jit's static data must
    be hashable."""

    __hash__ = object.__hash__

    def __eq__(self, other) -> bool:
        return self is other


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Probe(MatmulWeight):
    """A float block weight that records the absmax of its matmul's input (calibration)
    into `record` ({(path, layer): absmax}), which its calibrate() call owns."""

    values: jax.Array
    layer: jax.Array  # int32; [layers] stored, one scalar per layer inside the scan
    path: tuple = dataclasses.field(metadata={"static": True})
    record: _AbsMax = dataclasses.field(metadata={"static": True})

    def __getitem__(self, index):
        return self

    def astype(self, dtype):
        return self.values.astype(dtype)

    def einsum(self, equation, x, dtype):
        jax.debug.callback(functools.partial(_record, self.record, self.path), self.layer,
                           jnp.max(jnp.abs(x.astype(jnp.float32))))
        return jnp.einsum(equation, x, self.values.astype(dtype))


def _record(record: dict, path, layer, absmax) -> None:
    key = (path, int(layer))
    record[key] = max(record.get(key, 0.0), float(absmax))


def calibrate(loaded, axes_by_path: dict, batches) -> dict:
    """{block weight path: [layers] absmax of its input over the batches}."""
    flat = traverse_util.flatten_dict(loaded.params)
    probed = [p for p in quantized_paths(axes_by_path) if axes_by_path[p][0] == "layers"]
    layers = loaded.setup.spec.num_layers
    absmax = _AbsMax()
    for path in probed:
        flat[path] = _Probe(flat[path], jnp.arange(layers, dtype=jnp.int32), path, absmax)
    probes = traverse_util.unflatten_dict(flat)
    setup = loaded.setup
    with jax.set_mesh(setup.mesh):
        eval_step = loaded.loss_step()
        for batch in batches:
            jax.block_until_ready(eval_step(probes, to_global(batch, setup.tokens_sharding)))
    return {path: jnp.asarray([absmax[(path, i)] for i in range(layers)])
            for path in probed}


def directory_bytes(path) -> int:
    """The bytes of every file under a directory or object under a prefix."""
    return sum(storage.listing(path).values())
