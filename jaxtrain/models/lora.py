"""LoRA: low-rank adapters on chosen weight matmuls, the base weights frozen.

A targeted weight W computes x@W + (alpha/rank)·(x@A)@B (models/layers.py LowRank), as
PEFT's LoRA does: A [W's input axes, rank] drawn as PEFT's kaiming-uniform (±1/√fan_in),
B [rank, W's output axes] zeros, so that step 0 is the base model. The adapters are
nnx.Params named `lora_<weight>` beside the weight they adapt, with the weight's logical
axes and a `lora` axis (replicated: mesh.py's rules), stacked over layers like every other
parameter: they shard, remat and cast as the weight does. The routed experts of an MoE
layer ([E, D, F] and [E, F, D]) get one adapter per expert, folded into the expert weights
before the dispatch (W + scale·A@B per expert), so that every dispatch path and expert
mesh runs them unchanged.

Which weights take adapters is `model.lora.targets`, a comma list of TARGETS' names: one
entry per target (which module, which weights, the PEFT module name for Hugging Face).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from jaxtrain.errors import fail
from jaxtrain.models import base_storage
from jaxtrain.models.families import FAMILIES
from jaxtrain.models.layers import LowRank, MatmulWeight

PREFIX = "lora_"  # an adapter's attribute: lora_<the weight's name without w_>
DEFAULT_TARGETS = "q,k,v,o"  # every attention projection (QLoRA's finding: more is better)


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """One `model.lora.targets` value: the weights of one module kind it adapts."""

    name: str
    doc: str
    module: str  # "attention", "mlp" (a dense MLP, also MoE shared experts) or "experts"
    weights: tuple[str, ...]  # the module's weight attributes
    peft: str | None  # the Hugging Face (llama family) module PEFT targets; None: none

    def problem(self, family: str, experts: int, every_n_layers: int,
                shared_experts: int) -> str | None:
        """Why this model has no such weight (None: it has)."""
        if self.name == "gate" and not FAMILIES[family].gated_mlp:
            return f"model.family={family!r} has no gate projection (its MLP is not gated)"
        if self.module == "experts" and not experts:
            return "experts needs an MoE model (model.moe.num_experts > 0)"
        if self.module == "mlp" and experts and every_n_layers == 1 and not shared_experts:
            return (f"{self.name} adapts dense MLPs, and every MLP of this model is a mixture "
                    "of experts: use experts")
        return None


TARGETS: dict[str, LoraTarget] = {t.name: t for t in (
    LoraTarget("q", "attention's query projection", "attention", ("w_q",), "q_proj"),
    LoraTarget("k", "attention's key projection", "attention", ("w_k",), "k_proj"),
    LoraTarget("v", "attention's value projection", "attention", ("w_v",), "v_proj"),
    LoraTarget("o", "attention's output projection", "attention", ("w_o",), "o_proj"),
    LoraTarget("up", "the dense MLP's up projection", "mlp", ("w_up",), "up_proj"),
    LoraTarget("gate", "the dense MLP's gate projection (SwiGLU)", "mlp", ("w_gate",),
               "gate_proj"),
    LoraTarget("down", "the dense MLP's down projection", "mlp", ("w_down",), "down_proj"),
    LoraTarget("experts", "every routed expert's up, gate and down projections (one "
               "adapter per expert)", "experts", ("w_up", "w_gate", "w_down"), None),
)}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_dtype: str = "float32"  # the frozen base's storage (models/base_storage.py)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, m) -> LoraSpec | None:
        if not m.lora.rank:
            return None
        return cls(m.lora.rank, float(m.lora.alpha), parse_targets(m.lora.targets),
                   str(m.lora.base_dtype))

    def adapts(self, module: str, weight: str) -> bool:
        return any(TARGETS[t].module == module and weight in TARGETS[t].weights
                   for t in self.targets)


def parse_targets(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def defaults() -> dict:
    """The `model.lora` section of config.base_config() (docs/finetune.md): rank 0 trains
    every weight."""
    return {
        "rank": 0,  # the adapters' rank; 0: off
        "alpha": 16.0,  # their output is scaled by alpha/rank (as PEFT's lora_alpha)
        "targets": DEFAULT_TARGETS,  # comma list: q,k,v,o,up,gate,down,experts
        "dropout": 0.0,  # only 0.0 (no dropout) is implemented
        # The frozen base: a run directory (local, gs://, s3://) whose newest checkpoint's
        # parameters it is (jaxtrain convert --from-hf ... --workdir BASE, or any training
        # run); empty: the base is initialised from `seed` (tests, benchmarks).
        "base": "",
        # optimizer.weight_decay applies to the adapters (A and B), as PEFT under the
        # Hugging Face Trainer decays every trainable weight; False: never decay them.
        "weight_decay": True,
        # How the frozen base is held (models/base_storage.py): float32 (as trained),
        # bfloat16, int8 (per-channel absmax) or nf4 (QLoRA); each block matmul weight is
        # read back per layer, inside the layer scan, in the compute dtype.
        "base_dtype": "float32",
    }


def check(c) -> None:
    """ConfigError for a model.lora setting that cannot work (called by config.validate)."""
    m, lora = c.model, c.model.lora
    if lora.rank < 0:
        fail("model.lora.rank", lora.rank, "must be 0 (off) or >= 1")
    if lora.base_dtype not in base_storage.STORAGES:
        fail("model.lora.base_dtype", lora.base_dtype,
             f"one of {', '.join(base_storage.STORAGES)}")
    if not lora.rank:
        if lora.base_dtype != "float32":
            fail("model.lora.base_dtype", lora.base_dtype, "a frozen base's storage needs "
                 "LoRA (model.lora.rank >= 1); without it every weight trains in float32")
        return
    if lora.alpha <= 0:
        fail("model.lora.alpha", lora.alpha, "must be > 0 (the adapters' scale is alpha/rank)")
    if not 0 <= lora.dropout < 1:
        fail("model.lora.dropout", lora.dropout, "must be in [0, 1)")
    if lora.dropout:
        fail("model.lora.dropout", lora.dropout, "only 0.0 is supported (LoRA dropout is not "
             "implemented)")
    targets = parse_targets(lora.targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        fail("model.lora.targets", lora.targets, "a comma list of distinct names among "
             f"{', '.join(TARGETS)}")
    for t in targets:
        if problem := TARGETS[t].problem(m.family, m.moe.num_experts, m.moe.every_n_layers,
                                         m.moe.shared_experts):
            fail("model.lora.targets", lora.targets, problem)
        if m.mla.kv_lora_rank and TARGETS[t].module == "attention":
            fail("model.lora.targets", lora.targets, f"{t!r} adapts a GQA projection, and "
                 "model.mla's latent attention has none (adapt the MLP targets)")
    base_storage.check(lora.base_dtype, _input_widths(m))
    name, width = min(((t, _width(m, t)) for t in targets), key=lambda tw: tw[1])
    if lora.rank > width:
        fail("model.lora.rank", lora.rank, f"at most {width}, the width (min(in, out)) of "
             f"target {name} ({TARGETS[name].doc}): a larger rank adds nothing but cost")


def _input_widths(m) -> dict[str, int]:
    """Each block matmul weight's input width (what NF4's blocks of 64 cut)."""
    head_dim = m.head_dim or m.d_model // m.num_heads
    mlp = [m.mlp_dim] if not m.moe.num_experts or m.moe.every_n_layers > 1 else []
    mlp += [m.moe.expert_mlp_dim or m.mlp_dim] if m.moe.num_experts else []
    return {"w_q": m.d_model, "w_k": m.d_model, "w_v": m.d_model,
            "w_o": m.num_heads * head_dim, "w_up": m.d_model, "w_down": min(mlp)}


def _width(m, target: str) -> int:
    """min(input, output) of the narrowest weight `target` adapts in this model."""
    head_dim = m.head_dim or m.d_model // m.num_heads
    heads, kv_heads = m.num_heads * head_dim, (m.num_kv_heads or m.num_heads) * head_dim
    experts = m.moe.num_experts
    expert_mlp = m.moe.expert_mlp_dim or m.mlp_dim
    if target in ("q", "o"):
        return min(m.d_model, heads)
    if target in ("k", "v"):
        return min(m.d_model, kv_heads)
    if target == "experts":
        return min(m.d_model, expert_mlp)
    mlps = [m.mlp_dim] if not experts or m.moe.every_n_layers > 1 else []
    mlps += [m.moe.shared_experts * expert_mlp] if experts and m.moe.shared_experts else []
    return min(m.d_model, *mlps)


class Adapter(nnx.Module):
    """A [in..., rank] and B [rank, out...] of one weight (a leading `experts` axis for
    routed experts)."""

    def __init__(self, rank: int, shape_in, axes_in, shape_out, axes_out, dtype,
                 rngs: nnx.Rngs, experts: tuple = ()):
        lead, lead_axes = experts[:1], experts[1:]
        bound = 1 / math.sqrt(math.prod(shape_in))
        self.a = nnx.Param(jax.random.uniform(rngs.params(), (*lead, *shape_in, rank), dtype,
                                              -bound, bound),
                           axes=(*lead_axes, *axes_in, "lora"))
        self.b = nnx.Param(jnp.zeros((*lead, rank, *shape_out), dtype),
                           axes=(*lead_axes, "lora", *axes_out))


def adapter(spec, module: str, weight: nnx.Param, name: str, split: int, rngs: nnx.Rngs,
            experts: bool = False) -> Adapter | None:
    """The adapter of `weight` (its first `split` axes are the input, after the experts
    axis if any) when model.lora targets it, else None."""
    lora = spec.lora
    if lora is None or not lora.adapts(module, name):
        return None
    shape, axes = weight.shape, weight.get_metadata()["axes"]
    lead = 1 if experts else 0
    return Adapter(lora.rank, shape[lead:lead + split], axes[lead:lead + split],
                   shape[lead + split:], axes[lead + split:], weight.dtype, rngs,
                   (shape[0], axes[0]) if experts else ())


def weight(spec, w: jax.Array, lora: Adapter | None):
    """What `dense` takes: the weight, with its adapter when it has one."""
    if lora is None:
        return w
    return LowRank(w, lora.a[...], lora.b[...], spec.lora.scale)


def folded(scale: float, w_EIO: jax.Array, a_EIR: jax.Array, b_ERO: jax.Array) -> jax.Array:
    """Per-expert W + scale·A@B, in W's dtype."""
    update = jnp.einsum("eir,ero->eio", a_EIR.astype(jnp.float32), b_ERO.astype(jnp.float32))
    return (w_EIO.astype(jnp.float32) + scale * update).astype(w_EIO.dtype)


def base_spec(spec):
    """The same model without adapters: the graph of the frozen base."""
    return dataclasses.replace(spec, lora=None)


def is_adapter(path: tuple) -> bool:
    return any(str(k).startswith(PREFIX) for k in path)


def split(params: dict) -> tuple[dict, dict]:
    """(adapters, base) of a model's nested parameter dict."""
    flat = traverse_util.flatten_dict(params)
    return (traverse_util.unflatten_dict({k: v for k, v in flat.items() if is_adapter(k)}),
            traverse_util.unflatten_dict({k: v for k, v in flat.items() if not is_adapter(k)}))


def join(base: dict, adapters: dict) -> dict:
    """The model's parameter dict from its frozen base and its adapters."""
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base),
                                         **traverse_util.flatten_dict(adapters)})


def merged(spec, params: dict) -> dict:
    """The base parameters with every adapter folded in (W + scale·A@B; stacked layers and
    experts alike): plain weights of the model without adapters, for export. A weight the
    base holds in a stored form (model.lora.base_dtype: bf16 bits, int8, nf4) stays a
    LowRank of its stored weight and adapters, which `plain` folds one layer at a time
    (hf/save.py), so that no float32 copy of the whole quantized base exists at once."""
    adapters, base = split(params)
    flat = traverse_util.flatten_dict(base)
    for path, pair in traverse_util.flatten_dict(adapters, is_leaf=_is_pair).items():
        target = path[:-1] + ("w_" + path[-1][len(PREFIX):],)
        w = flat[target]
        if isinstance(w, MatmulWeight):
            flat[target] = LowRank(w, pair["a"], pair["b"], spec.lora.scale)
        else:
            flat[target] = _fold(w, pair["a"], pair["b"], spec.lora.scale)
    return traverse_util.unflatten_dict(flat)


def _fold(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """W + scale·A@B in W's dtype, over any stacked (layer, expert) axes in front."""
    rank = a.shape[-1]
    lead = a.ndim + b.ndim - 2 - w.ndim  # stacked axes (layers, experts) in front
    a2 = a.reshape(*a.shape[:lead], -1, rank)
    b2 = b.reshape(*b.shape[:lead], rank, -1)
    update = jnp.einsum("...ir,...ro->...io", a2.astype(jnp.float32),
                        b2.astype(jnp.float32)).reshape(w.shape)
    return (w.astype(jnp.float32) + scale * update).astype(w.dtype)


def plain(value):
    """A tensor of merged()'s tree, or a slice of one (a layer), as a float array: a stored
    weight read back in float32 (the values the run trained on; an int8 weight has no
    dtype of its own), a LowRank of one with its adapter folded in, in float32 (a bf16
    weight plus a small update would lose the update to bf16's rounding)."""
    if isinstance(value, LowRank):
        return _fold(plain(value.w), value.a, value.b, value.scale)
    if isinstance(value, MatmulWeight):
        return value.astype(jnp.float32)
    return value


def _is_pair(_, x) -> bool:
    return isinstance(x, dict) and set(x) == {"a", "b"}
