"""How a Hugging Face tensor relates to jaxtrain parameters: the vocabulary the family
modules (gpt2.py, llama.py) describe their checkpoints in.

A family's config checks (Checks.equal: jaxtrain key, its value, config.json key, the value
there) are its config table, read both ways: checking a given config against config.json,
and, under `deriving`, recording config.json's value of each key (hf/model_config.py builds
a run's model config from config.json with them).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable

import numpy as np

Path = tuple[str, ...]
Transform = Callable[[np.ndarray], np.ndarray]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.T


@dataclasses.dataclass(frozen=True)
class Part:
    """A slice of an HF tensor that is one jaxtrain parameter (of one layer, for the
    stacked [layers, ...] parameters under 'blocks')."""

    path: Path  # the jaxtrain parameter
    size: int  # its extent along the HF tensor's `axis`
    to_jax: Transform = _same  # HF slice -> jaxtrain layout
    to_hf: Transform = _same  # jaxtrain layout -> HF slice


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF checkpoint: its parts laid side by side along `axis`."""

    name: str  # '{i}' stands for the layer index in per-layer tensors, '{e}' for the expert
    shape: tuple[int, ...]  # as exported
    parts: tuple[Part, ...]
    axis: int = 0
    longer_ok: bool = False  # on import the tensor may extend past the parts along `axis`
    # One HF tensor per expert ('{e}' in the name), stacked [layers, experts, ...] in jaxtrain.
    experts: int = 0
    # The HF layers stacked into the parameter, in order (its layers of one kind, where the
    # model stores dense and MoE layers apart); None: every layer.
    layers: tuple[int, ...] | None = None
    # The parts alternate element by element along `axis` (gpt-oss's gate_up_proj: gate at
    # even, up at odd indices) rather than lying side by side; parts of equal size.
    interleaved: bool = False
    # The axis holds `groups` equal groups, each the parts side by side (DeepSeek's
    # kv_b_proj: per head, k_nope's rows then v's); a part's size is its total over the
    # groups. 0: the parts side by side once.
    groups: int = 0

    @property
    def read_whole(self) -> bool:
        """Whether a part is cut from the whole tensor (select) rather than read as a slice."""
        return self.interleaved or bool(self.groups)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    def hf_layer(self, index: int) -> int:
        """The HF layer of the stacked parameter's `index`-th slice."""
        return index if self.layers is None else self.layers[index]

    def named(self, layer: int | None, expert: int | None = None) -> str:
        return self.name.format(i=layer, e=expert) if self.per_layer else self.name

    def names(self, layers: int) -> list[tuple[str, int | None, int | None]]:
        """(name, layer, expert) of every HF tensor this one stands for."""
        if not self.per_layer:
            return [(self.name, None, None)]
        return [(self.named(i, e), i, e) for i in (range(layers) if self.layers is None
                                                   else self.layers)
                for e in (range(self.experts) if self.experts else [None])]

    def select(self, value, offset: int, size: int):
        """A part's elements of the HF tensor `value` read whole along `axis` (interleaved),
        or `value` itself (already read as the part's slice)."""
        if self.groups:
            g = self.groups
            grouped = np.moveaxis(value, self.axis, 0)
            grouped = grouped.reshape(g, -1, *grouped.shape[1:])
            grouped = grouped[:, offset // g:(offset + size) // g]
            return np.moveaxis(grouped.reshape(size, *grouped.shape[2:]), 0, self.axis)
        if not self.interleaved:
            return value
        n = len(self.parts)
        return np.take(value, np.arange(offset // size, n * size, n), axis=self.axis)

    def join(self, pieces: list):
        """The HF tensor from its parts' pieces in HF layout."""
        if len(pieces) == 1:
            return pieces[0]
        if self.groups:
            g, moved = self.groups, [np.moveaxis(p, self.axis, 0) for p in pieces]
            both = np.concatenate([p.reshape(g, -1, *p.shape[1:]) for p in moved], axis=1)
            return np.moveaxis(both.reshape(-1, *both.shape[2:]), 0, self.axis)
        if self.interleaved:
            return np.stack(pieces, axis=self.axis + 1).reshape(self.shape)
        return np.concatenate(pieces, axis=self.axis)

    def shape_ok(self, shape: tuple[int, ...]) -> bool:
        if len(shape) != len(self.shape):
            return False
        return all(s == e or (a == self.axis and self.longer_ok and s >= e)
                   for a, (s, e) in enumerate(zip(shape, self.shape)))


def one(name: str, shape: tuple[int, ...], path: Path, to_jax: Transform = _same,
        to_hf: Transform = _same) -> HFTensor:
    """An HF tensor that is exactly one jaxtrain parameter."""
    return HFTensor(name, tuple(shape), (Part(path, shape[0], to_jax, to_hf),))


def linear(name: str, out_in: tuple[int, int], path: Path) -> HFTensor:
    """A torch Linear weight [out, in] that jaxtrain keeps as [in, out]."""
    return one(name, out_in, path, _transpose, _transpose)


def split_heads(name: str, path: Path, d: int, heads: int, head_dim: int,
                transposed: bool, out: bool = False) -> HFTensor:
    """A projection between D and heads×head_dim. HF: torch Linear [out, in] (transposed)
    or Conv1D [in, out]; jaxtrain: [D, heads, head_dim] in, [heads, head_dim, D] out."""
    hk = heads * head_dim
    jax_shape = (heads, head_dim, d) if out else (d, heads, head_dim)
    flat = (hk, d) if out else (d, hk)  # [in, out]
    shape = flat[::-1] if transposed else flat
    if transposed:
        return one(name, shape, path, lambda x: x.T.reshape(jax_shape),
                   lambda x: x.reshape(flat).T)
    return one(name, shape, path, lambda x: x.reshape(jax_shape), lambda x: x.reshape(flat))


# Floats of config.json and the config agree within this relative tolerance: config.json
# holds float32 values written out as float64 (rms_norm_eps 9.999999747378752e-06 is 1e-5).
FLOAT_REL_TOL = 1e-6

_DERIVED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("derived", default=None)


@contextlib.contextmanager
def deriving():
    """Within it, every Checks records config.json's value of each jaxtrain key it checks
    into the dict yielded ('model.d_model' -> 576)."""
    derived: dict = {}
    token = _DERIVED.set(derived)
    try:
        yield derived
    finally:
        _DERIVED.reset(token)


def same_value(ours, theirs) -> bool:
    """Equal, floats within FLOAT_REL_TOL."""
    if isinstance(ours, float) and isinstance(theirs, (int, float)) \
            and not isinstance(theirs, bool):
        return math.isclose(float(ours), float(theirs), rel_tol=FLOAT_REL_TOL)
    return ours == theirs


class Checks:
    """Collects every disagreement between config.json and the jaxtrain config, so that one
    error names them all."""

    def __init__(self):
        self.problems: list[str] = []
        self.derived = _DERIVED.get()

    def derive(self, key: str, theirs) -> None:
        """Records config.json's value of jaxtrain `key` ('model.x', maybe with a note after
        a space: 'model.head_dim (0: d_model/num_heads)') while deriving."""
        key = key.split(" ")[0]
        if self.derived is not None and key.startswith("model.") and theirs is not None:
            self.derived[key] = theirs

    def equal(self, key: str, ours, hf_key: str, theirs) -> None:
        self.derive(key, theirs)
        if not same_value(ours, theirs):
            self.problems.append(f"{key}={ours!r} but config.json {hf_key}={theirs!r}")

    def refuse(self, hf_key: str, value, why: str) -> None:
        self.problems.append(f"config.json {hf_key}={value!r} is not supported: {why}")
