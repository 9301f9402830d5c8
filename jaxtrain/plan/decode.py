"""The planner's decode facts: the bytes one generation-engine slot's KV cache takes
(jaxtrain/engine/: every layer's keys and values for GQA, the latent and rotary key for
MLA, every position kept, sliding-window layers included), what a window-sized cache would
need instead, how many slots fit on a device beside its share of the weights, and the
memory-bandwidth bound of a decode step (every weight and every slot's cache read once)."""

from __future__ import annotations

import math

import jax

from jaxtrain.mesh import logical_to_spec
from jaxtrain.models import ModelSpec
from jaxtrain.models.attention import KV_AXES, LATENT_AXES
from jaxtrain.models.mla import gqa_cache_bytes_per_token
from jaxtrain.plan import memory


def layer_bytes_per_token(spec: ModelSpec) -> int:
    """One layer's cache per token in the compute dtype (what the engine allocates)."""
    dtype_bytes = jax.numpy.dtype(spec.compute_dtype).itemsize
    if spec.mla is not None:
        return spec.mla.cache_bytes_per_token(dtype_bytes)
    return gqa_cache_bytes_per_token(spec.num_kv_heads, spec.head_dim, dtype_bytes)


def _splits(spec: ModelSpec, sizes: dict[str, int]) -> tuple[int, int]:
    """(ways a slot's cache splits over the mesh, ways the slots split): the cache is
    sharded as the engine constrains it (models/transformer.py init_cache)."""
    axes = LATENT_AXES if spec.mla is not None else KV_AXES
    pspec = tuple(logical_to_spec(axes, spec.rules)) + (None,) * len(axes)
    ways = [math.prod(sizes.get(a, 1) for a in
                      (() if m is None else (m,) if isinstance(m, str) else tuple(m)))
            for m in pspec[:len(axes)]]
    return math.prod(ways) // ways[1], ways[1]


def decode_plan(cfg, sizes: dict[str, int], hw, usable_bytes: float,
                max_len: int | None = None) -> dict:
    """Per device: the weights, a slot's cache of max_len positions (default
    model.seq_len), the slots that fit beside the weights, and the bandwidth-bound decode
    tokens/s at batch 1 and at the slots that fit."""
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes.get("pipeline", 1))
    positions = max_len or spec.seq_len
    per_layer = layer_bytes_per_token(spec)
    windows = [spec.layer_kind(kind).window(spec) for kind in
               (spec.layer_types or (None,) * spec.num_layers)]
    linear = [spec.layer_kind(kind).linear for kind in spec.layer_types]
    state = sum(linear) * spec.linear.state_bytes(jax.numpy.dtype(
        spec.compute_dtype).itemsize) if spec.linear is not None else 0
    attending = spec.num_layers - sum(linear)  # a linear layer's state: the same any length
    slot = attending * positions * per_layer + state
    windowed = sum(min(w or positions, positions) for w, lin in
                   zip(windows, linear or [False] * len(windows)) if not lin) * per_layer \
        + state
    split, slot_ways = _splits(spec, sizes)
    weights = memory.param_shards(spec, sizes)["total"] * \
        jax.numpy.dtype(spec.param_dtype).itemsize
    slot_device = slot / split
    slots = max(0, int((usable_bytes - weights) // slot_device)) * slot_ways
    out = {"max_len": positions, "cache_bytes_per_token": attending * per_layer,
           "recurrent_state_bytes_per_slot": state,
           "cache_bytes_per_slot": slot, "window_cache_bytes_per_slot": windowed,
           "cache_bytes_per_slot_per_device": slot_device, "weight_bytes_per_device": weights,
           "slots_that_fit": slots}
    bandwidth = hw.memory_bw_gbps * 1e9
    for batch, name in ((1, "bound_tokens_per_s_batch_1"),
                        (max(slots, 1), "bound_tokens_per_s_at_fit")):
        per_device = math.ceil(batch / slot_ways)
        out[name] = batch * bandwidth / (weights + per_device * slot_device)
    return out


def describe(d: dict, gb) -> list[str]:
    window = "" if d["window_cache_bytes_per_slot"] == d["cache_bytes_per_slot"] else \
        f" (a window-sized cache: {gb(d['window_cache_bytes_per_slot'])})"
    return ["decode (generation engine, per device):",
            f"  KV cache {gb(d['cache_bytes_per_slot'])} a slot of {d['max_len']} positions"
            f"{window}{_state(d, gb)}; {d['slots_that_fit']} slots fit beside "
            f"{gb(d['weight_bytes_per_device'])} of weights",
            f"  bandwidth bound {d['bound_tokens_per_s_batch_1']:,.0f} tokens/s at batch 1, "
            f"{d['bound_tokens_per_s_at_fit']:,.0f} at {max(d['slots_that_fit'], 1)} slots"]


def _state(d: dict, gb) -> str:
    state = d.get("recurrent_state_bytes_per_slot", 0)
    return f" (of which {gb(state)} linear-attention state, any length)" if state else ""
