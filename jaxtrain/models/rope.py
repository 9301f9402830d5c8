"""Rotary position embeddings and their scaling for context extension (`model.rope_scaling`).

A scaling changes only the per-pair frequencies (and, for YaRN, multiplies cos and sin by an
attention factor), so a model pretrained at `original_max_position_embeddings` tokens can be
fine-tuned or run at a longer `model.seq_len`. The names and formulas are transformers' own
(`modeling_rope_utils`), so that a Hugging Face `rope_parameters` / `rope_scaling` dict maps
one to one onto the config section (hf/llama.py):

    type            none | llama3 | yarn
    factor          how much longer the context is than the original (llama3, yarn)
    original_max_position_embeddings   the pretraining length (llama3, yarn)
    low_freq_factor, high_freq_factor  llama3: wavelengths above original/low are divided
                    by factor, below original/high kept, smoothly blended between
    beta_fast, beta_slow   yarn: the rotation counts bounding the blend between
                    interpolated and extrapolated frequencies
    attention_factor       yarn: the cos/sin multiplier; 0 derives 0.1·ln(factor) + 1
    truncate        yarn: round the blend's bounds to whole dimensions (transformers' default)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.errors import fail


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """model.rope_scaling, resolved once (the module docstring has the fields)."""

    type: str = "none"
    factor: float = 8.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    truncate: bool = True

    @classmethod
    def from_config(cls, section) -> RopeScaling:
        return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})


def _llama3(freq_K: np.ndarray, s: RopeScaling) -> tuple[np.ndarray, float]:
    """Llama 3.1: long wavelengths interpolated by `factor`, short ones kept, a smooth
    blend between."""
    wavelen_K = 2 * math.pi / freq_K
    old = s.original_max_position_embeddings
    scaled_K = np.where(wavelen_K > old / s.low_freq_factor, freq_K / s.factor, freq_K)
    smooth_K = (old / wavelen_K - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended_K = (1 - smooth_K) * scaled_K / s.factor + smooth_K * scaled_K
    medium_K = (wavelen_K >= old / s.high_freq_factor) & (wavelen_K <= old / s.low_freq_factor)
    return np.where(medium_K, blended_K, scaled_K), 1.0


def _yarn(freq_K: np.ndarray, s: RopeScaling, theta: float, dim: int
          ) -> tuple[np.ndarray, float]:
    """YaRN: frequencies blended from interpolated (÷factor) to extrapolated (kept) over
    the dimensions between beta_slow and beta_fast rotations in the original length."""
    def correction_dim(rotations):
        return dim * math.log(s.original_max_position_embeddings
                              / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp_K = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrapolate_K = 1 - ramp_K
    freq_out_K = freq_K / s.factor * (1 - extrapolate_K) + freq_K * extrapolate_K
    factor = s.attention_factor or (0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)
    return freq_out_K, factor


_SCALINGS: dict[str, Callable | None] = {
    "none": None,
    "llama3": lambda freq_K, s, theta, dim: _llama3(freq_K, s),
    "yarn": _yarn,
}
ROPE_SCALINGS = tuple(_SCALINGS)


def defaults() -> dict:
    """The `model.rope_scaling` section of config.base_config(): RoPE scaling for context
    extension; the names are transformers' rope_parameters keys, so HF import/export maps
    them 1:1."""
    return {
        "type": "none",  # none | llama3 | yarn
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,  # llama3
        "high_freq_factor": 4.0,  # llama3
        "beta_fast": 32.0,  # yarn
        "beta_slow": 1.0,  # yarn
        "attention_factor": 0.0,  # yarn; 0: 0.1·ln(factor) + 1
        "truncate": True,  # yarn
    }


def check(section) -> None:
    """One-line errors for model.rope_scaling."""
    kind = section.type
    if kind not in _SCALINGS:
        fail("model.rope_scaling.type", kind, f"valid values are {', '.join(_SCALINGS)}")
    if kind == "none":
        return
    if section.factor < 1:
        fail("model.rope_scaling.factor", section.factor, "must be >= 1 (the context "
             "extension ratio)")
    if section.original_max_position_embeddings < 1:
        fail("model.rope_scaling.original_max_position_embeddings",
             section.original_max_position_embeddings, "must be >= 1 (the pretraining length)")
    if kind == "llama3" and section.high_freq_factor <= section.low_freq_factor:
        fail("model.rope_scaling.high_freq_factor", section.high_freq_factor,
             f"must be > model.rope_scaling.low_freq_factor={section.low_freq_factor}")
    if kind == "yarn" and section.beta_fast <= section.beta_slow:
        fail("model.rope_scaling.beta_fast", section.beta_fast,
             f"must be > model.rope_scaling.beta_slow={section.beta_slow}")
    if kind == "yarn" and section.attention_factor < 0:
        fail("model.rope_scaling.attention_factor", section.attention_factor,
             "must be > 0, or 0 to derive it from the factor")


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None
                ) -> tuple[np.ndarray, float]:
    """(float32 [head_dim/2] rotation frequencies, the cos/sin multiplier), static."""
    freq_K = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    scale = 1.0
    if scaling is not None and (fn := _SCALINGS[scaling.type]) is not None:
        freq_K, scale = fn(freq_K, scaling, theta, head_dim)
    return freq_K.astype(np.float32), scale


def rope(x_BLHK: jax.Array, theta: float, positions_L: jax.Array | None = None,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary position embedding, rotating the two halves of each head (Llama/HF layout).
    positions_L: each position's index (default 0..L-1; decoding passes its offset), or
    [B, L] per row (packed documents restart at 0 at each document). scaling: the
    model.rope_scaling frequencies (None: plain RoPE)."""
    length, head_dim = x_BLHK.shape[1], x_BLHK.shape[-1]
    if positions_L is None:
        positions_L = jnp.arange(length)
    freq_K, scale = frequencies(head_dim, theta, scaling)
    angle_xLK = positions_L.astype(jnp.float32)[..., None] * freq_K
    if angle_xLK.ndim == 2:
        angle_xLK = angle_xLK[None]
    sin, cos = jnp.sin(angle_xLK)[:, :, None, :], jnp.cos(angle_xLK)[:, :, None, :]
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
