"""Mixture-of-experts feed-forward (Mixtral style): a router picks the top k of E experts
for each token, whose outputs are summed with the router's softmax probabilities
renormalised over the k picked (or as they are: model.moe.norm_topk_prob false); optional
shared experts (DeepSeek/Qwen style) run on every token. What an expert computes is the
family's expert kind (models/families.py EXPERT_KINDS: SwiGLU, or gpt-oss's clamped SwiGLU
with biases on its projections and on the router's logits). Expert parallelism: the experts
are sharded over the `expert` mesh axis and tokens travel to their experts and back by
all-to-all inside a shard_map.

Two ways to run the experts (`model.moe.dispatch`, one DISPATCHES entry each):
- dropless: the token×choice rows sorted by expert and multiplied with `jax.lax.ragged_dot`
  (one grouped matmul per projection); nothing is dropped. Across the expert axis the rows
  travel by `ragged_all_to_all` (GPU/TPU; XLA:CPU lacks it, so on CPU an all-gather stands
  in for it: same offsets, same result, for tests).
- capacity: each expert takes at most C = ⌈capacity_factor·T·k/E⌉ of a device's T tokens
  (first come, first served in batch order) into a fixed [E, C, D] buffer; the rest are
  dropped (counted in `moe_dropped_fraction`) and pass through on the residual alone. Plain
  batched matmuls, and a fixed-size all-to-all across the expert axis.

Inside the shard_map the layer is manual over every mesh axis: tokens are split as the
activations' `batch`/`length` rules say, the experts' `embed` dimension is all-gathered
(FSDP; its transpose reduce-scatters the gradients) and their `mlp` dimension summed over
(tensor parallelism), exactly as XLA's partitioner does for the dense MLP.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import fail
from jaxtrain.mesh import logical_to_spec
from jaxtrain.models import lora
from jaxtrain.models.families import EXPERT_KINDS, FAMILIES
from jaxtrain.models.layers import param
from jaxtrain.models.mlp import Mlp

ROUTER_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Per-row routing statistics each MoE layer returns (summed over the row's tokens); the
# losses and metrics are formed from their batch sums (routing_losses), so they come out
# the same however the batch is split across devices or pipeline micro-batches.
STAT_NAMES = ("load", "prob", "z", "dropped")


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """One `model.moe.dispatch` value: how an MoE layer runs its experts, its checks, and
    the facts the planner counts its buffers and traffic from."""

    name: str
    doc: str
    # (moe, axes, x_TD, route, experts, drop) -> (y_AD, dropped_A), both in the route's
    # sorted row order.
    run: Callable
    # 'auto' picks it on these platforms ("*": on any platform no other entry names).
    default_on: tuple[str, ...]
    # (config, mesh axis sizes) -> None, raising ConfigError: what it cannot run under.
    check: Callable | None = None
    # Planner: its buffers hold capacity_factor·k rows per token, padding included (else
    # exactly the k routed rows), and the exchange moves the whole buffers;
    padded: bool = False
    # under expert parallelism each device provides room for every expert-axis peer's rows
    # (the worst case: _dropless_exchanged);
    peer_buffers: bool = False
    # its experts are grouped matmuls (ragged_dot), which XLA:CPU expands into one masked
    # dense matmul per local expert.
    grouped_matmuls: bool = False

    def validate(self, c, sizes: dict[str, int]) -> None:
        if self.check is not None:
            self.check(c, sizes)

def defaults() -> dict:
    """The `model.moe` section (docs/parallelism.md); num_experts 0: a dense model."""
    return {
        "num_experts": 0,  # E routed experts per MoE layer (>= 2), llama family
        "top_k": 2,  # experts per token
        # Their router probabilities renormalised to sum to 1 (Mixtral); False: the softmax's
        # own (Qwen3-MoE's norm_topk_prob false)
        "norm_topk_prob": True,
        "expert_mlp_dim": 0,  # each expert's SwiGLU width; 0: model.mlp_dim
        "shared_experts": 0,  # always-on experts of expert_mlp_dim (DeepSeek/Qwen)
        "every_n_layers": 1,  # layers n-1, 2n-1, ... are MoE, the rest dense
        # The first k layers dense, the rest MoE (DeepSeek's first_k_dense_replace; needs
        # every_n_layers 1)
        "first_dense_layers": 0,
        "router_dtype": "float32",  # the router's matmul (softmax is always float32)
        "aux_loss_weight": 0.01,  # load balancing: (E/k)·Σ f·P, 1.0 when balanced
        "z_loss_weight": 0.001,  # router z-loss: mean logsumexp(logits)²
        # capacity dispatch: an expert takes at most ⌈capacity_factor·T·k/E⌉ of a device's
        # T tokens, the rest are dropped (moe_dropped_fraction in metrics.jsonl).
        "capacity_factor": 1.25,
        # auto: dropless on TPU (grouped matmuls), capacity on CPU and GPU; or either by name.
        "dispatch": "auto",
    }


def dispatch_choices() -> tuple[str, ...]:
    """model.moe.dispatch's valid values (read when asked, so a new entry is one)."""
    return ("auto", *DISPATCHES)


def resolve_dispatch(name: str, platform: str) -> str:
    if name != "auto":
        return name
    named = [d.name for d in DISPATCHES.values() if platform in d.default_on]
    return (named or [d.name for d in DISPATCHES.values() if "*" in d.default_on])[0]


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """model.moe, resolved once (None in ModelSpec for a dense model)."""

    num_experts: int
    top_k: int
    expert_mlp_dim: int
    shared_experts: int = 0  # always-on experts, run as one SwiGLU of shared×expert_mlp_dim
    every_n_layers: int = 1  # layers n-1, 2n-1, ... are MoE; the rest dense
    first_dense_layers: int = 0  # layers 0..k-1 dense before the MoE groups
    router_dtype: Any = jnp.float32
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    capacity_factor: float = 1.25
    dispatch: str = "capacity"  # resolved: dropless or capacity
    ragged_collectives: bool = False  # ragged_all_to_all exists (GPU/TPU), else emulated
    norm_topk_prob: bool = True  # the k weights renormalised to sum to 1
    # What each expert computes (models/families.py EXPERT_KINDS, the family's `experts`)
    expert_kind: str = "swiglu"

    @property
    def kind(self):
        return EXPERT_KINDS[self.expert_kind]

    @classmethod
    def from_config(cls, m, platform: str) -> MoeSpec | None:
        moe = m.moe
        if not moe.num_experts:
            return None
        return cls(num_experts=moe.num_experts, top_k=moe.top_k,
                   expert_mlp_dim=moe.expert_mlp_dim or m.mlp_dim,
                   shared_experts=moe.shared_experts, every_n_layers=moe.every_n_layers,
                   first_dense_layers=moe.first_dense_layers,
                   router_dtype=ROUTER_DTYPES[moe.router_dtype],
                   aux_loss_weight=moe.aux_loss_weight, z_loss_weight=moe.z_loss_weight,
                   capacity_factor=moe.capacity_factor,
                   dispatch=resolve_dispatch(moe.dispatch, platform),
                   ragged_collectives=platform in ("gpu", "tpu"),
                   norm_topk_prob=moe.norm_topk_prob,
                   expert_kind=FAMILIES[m.family].expert_kind.name)

    def layers(self, num_layers: int) -> int:
        """How many of the model's layers are MoE."""
        return (num_layers - self.first_dense_layers) // self.every_n_layers

    def active_matmul_params(self, d_model: int) -> int:
        """Weights one token multiplies with in an MoE layer: router, k experts, shared."""
        per_expert = 3 * d_model * self.expert_mlp_dim
        return d_model * self.num_experts + (self.top_k + self.shared_experts) * per_expert

    def capacity(self, tokens: int, drop: bool) -> int:
        """Slots per expert for `tokens` tokens: all of them (nothing can drop) or
        ⌈capacity_factor·tokens·k/E⌉."""
        if not drop:
            return tokens
        wanted = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
        return max(1, min(tokens, wanted))


def check(c, platform: str | None) -> None:
    """ConfigError for a model.moe setting that cannot work (called by config.validate)."""
    m, moe = c.model, c.model.moe
    if not FAMILIES[m.family].dense_mlp and (moe.num_experts < 2 or moe.every_n_layers != 1):
        key, value = (("model.moe.num_experts", moe.num_experts) if moe.num_experts < 2 else
                      ("model.moe.every_n_layers", moe.every_n_layers))
        fail(key, value, f"model.family={m.family!r} has no dense feed-forward layers: every "
             "layer is MoE (model.moe.num_experts >= 2, model.moe.every_n_layers=1)")
    if moe.num_experts < 0:
        fail("model.moe.num_experts", moe.num_experts, "must be 0 (a dense model) or >= 2")
    if not moe.num_experts:
        return
    if moe.num_experts < 2:
        fail("model.moe.num_experts", moe.num_experts, "must be 0 (a dense model) or >= 2")
    if not FAMILIES[m.family].takes_experts:
        able = " or ".join(f"{f.name!r}" for f in FAMILIES.values() if f.takes_experts)
        fail("model.moe.num_experts", moe.num_experts, f"model.family={m.family!r} names no "
             f"expert kind: MoE needs model.family={able}")
    if not 1 <= moe.top_k <= moe.num_experts:
        fail("model.moe.top_k", moe.top_k, f"must be between 1 and model.moe.num_experts="
             f"{moe.num_experts}")
    for key in ("shared_experts", "expert_mlp_dim"):
        if moe[key] < 0:
            fail(f"model.moe.{key}", moe[key], "must be >= 0")
    n, first = moe.every_n_layers, moe.first_dense_layers
    if n < 1 or m.num_layers % n:
        fail("model.moe.every_n_layers", n, f"must divide model.num_layers={m.num_layers} "
             "(layers n-1, 2n-1, ... are MoE)")
    if first and (n != 1 or not 0 < first < m.num_layers or m.layer_types):
        fail("model.moe.first_dense_layers", first, f"must be between 0 and model.num_layers-1"
             f"={m.num_layers - 1}, with model.moe.every_n_layers=1 and no model.layer_types "
             "(the dense layers come first, then every layer is MoE)")
    if moe.router_dtype not in ROUTER_DTYPES:
        fail("model.moe.router_dtype", moe.router_dtype,
             f"valid values are {', '.join(ROUTER_DTYPES)}")
    for key in ("aux_loss_weight", "z_loss_weight"):
        if moe[key] < 0:
            fail(f"model.moe.{key}", moe[key], "must be >= 0")
    if moe.capacity_factor <= 0:
        fail("model.moe.capacity_factor", moe.capacity_factor, "must be > 0")
    if moe.dispatch not in dispatch_choices():
        fail("model.moe.dispatch", moe.dispatch,
             f"valid values are {', '.join(dispatch_choices())}")


class MoeMlp(nnx.Module):
    """Router, E experts (stacked [E, ...] weights, `experts` logical axis) and the optional
    shared experts. __call__(x_BLD, drop) -> (y_BLD, per-row routing stats)."""

    def __init__(self, spec, *, rngs: nnx.Rngs):
        self.spec = spec
        moe, dt = spec.moe, spec.param_dtype
        d, e, f = spec.d_model, moe.num_experts, moe.expert_mlp_dim
        out_std = spec.init_std / (2 * spec.num_layers) ** 0.5
        self.w_router = param(rngs, (d, e), ("embed", None), spec.init_std, dt)
        self.w_up = param(rngs, (e, d, f), ("experts", "embed", "mlp"), spec.init_std, dt)
        self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "mlp"), spec.init_std, dt)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), out_std, dt)
        if moe.shared_experts:
            self.shared = Mlp(spec, width=moe.shared_experts * f, rngs=rngs)
        for name in ("up", "gate", "down"):  # after the base weights: the same draws
            setattr(self, f"lora_{name}", lora.adapter(
                spec, "experts", getattr(self, f"w_{name}"), f"w_{name}", 1, rngs,
                experts=True))
        if moe.kind.bias:  # zeros: no draws
            self.b_router = param(rngs, (e,), (None,), 0.0, dt)
            self.b_up = param(rngs, (e, f), ("experts", "mlp"), 0.0, dt)
            self.b_gate = param(rngs, (e, f), ("experts", "mlp"), 0.0, dt)
            self.b_down = param(rngs, (e, d), ("experts", "embed"), 0.0, dt)

    def __call__(self, x_BLD: jax.Array, drop: bool = True):
        spec = self.spec
        weights = (self.w_router[...], *(self._expert_weight(n) for n in ("up", "gate", "down")))
        if spec.moe.kind.bias:  # the router's bias rides as its state (added to its logits)
            biases = tuple(getattr(self, f"b_{n}")[...] for n in ("up", "gate", "down"))
            y_BLD, stats = routed_experts(spec, x_BLD, weights, drop,
                                          route_state=(self.b_router[...],), biases=biases)
        else:
            y_BLD, stats = routed_experts(spec, x_BLD, weights, drop)
        if spec.moe.shared_experts:
            y_BLD = y_BLD + self.shared(x_BLD)
        return y_BLD, stats


    def _expert_weight(self, name: str) -> jax.Array:
        """[E, ...], with its per-expert LoRA adapter folded in where it has one."""
        w, adapter = getattr(self, f"w_{name}")[...], getattr(self, f"lora_{name}")
        if adapter is None:
            return w
        return lora.folded(self.spec.lora.scale, w, adapter.a[...], adapter.b[...])


@dataclasses.dataclass(frozen=True)
class _Axes:
    """Mesh axes (tuples; empty: none) as the layer's shard_map sees them."""

    experts: tuple = ()  # the experts' dimension: all-to-all over these
    embed: tuple = ()  # the experts' model dimension: all-gathered (FSDP)
    mlp: tuple = ()  # the experts' hidden dimension: partial sums reduced (tensor)
    length: tuple = ()  # the tokens' length dimension: per-row statistics reduced
    expert_shards: int = 1  # devices the experts are split over


def _mesh_axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def routed_experts(spec, x_BLD, weights, drop: bool, route: Callable | None = None,
                   route_state: tuple = (), biases: tuple = ()):
    """The routed experts' output and per-row stats; in a shard_map over the whole mesh
    when there is one (plain local code without). route: (moe, x_TD, w_router_DE,
    *route_state) -> _Route, another router (models/router.py ROUTERS; default the softmax
    top-k here); route_state: its replicated arrays (a correction bias, the router's logit
    bias); biases: the experts' (b_up_EF, b_gate_EF, b_down_ED) of an expert kind with
    biases, else ()."""
    route = route or _route
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _local(spec, _Axes(), drop, route, x_BLD, *weights, biases, *route_state)
    rules = spec.rules
    tokens = logical_to_spec(("batch", "length", None), rules)
    w_in = logical_to_spec(("experts", "embed", "mlp"), rules)
    w_out = logical_to_spec(("experts", "mlp", "embed"), rules)
    axes = _Axes(*(_mesh_axes(w_in[i]) for i in range(3)), length=_mesh_axes(tokens[1]))
    axes = dataclasses.replace(axes, expert_shards=math.prod(mesh.shape[a] for a in axes.experts))
    token_axes = set(_mesh_axes(tokens[0])) | set(axes.length)
    assert set(axes.experts) <= token_axes and not token_axes & set(axes.mlp), (
        "the batch rule must include the experts' mesh axes and exclude the mlp ones", rules)
    rows = P(tokens[0])
    stats_specs = {name: rows for name in STAT_NAMES}
    body = functools.partial(_local, spec, axes, drop, route)
    # The up/gate biases split as the experts' hidden dimension; the down bias whole (added
    # per token after the tensor-parallel sum).
    b_in = logical_to_spec(("experts", "mlp"), rules)
    bias_specs = (b_in, b_in, P()) if biases else ()
    return jax.shard_map(body, in_specs=(tokens, P(), w_in, w_in, w_out, bias_specs,
                                         *(P() for _ in route_state)),
                         out_specs=(P(tokens[0], tokens[1]), stats_specs))(
        x_BLD, *weights, biases, *route_state)


def _local(spec, axes: _Axes, drop: bool, route, x_BLD, w_router_DE, w_up_EDF, w_gate_EDF,
           w_down_EFD, biases, *route_state):
    """One device's tokens through the router and the experts (whose other shards it
    reaches through the collectives over `axes`)."""
    moe, dt = spec.moe, spec.compute_dtype
    b, length, d = x_BLD.shape
    if axes.embed:  # FSDP: gather the experts' model dimension; the transpose scatters grads
        w_up_EDF, w_gate_EDF = (jax.lax.all_gather(w, axes.embed, axis=1, tiled=True)
                                for w in (w_up_EDF, w_gate_EDF))
        w_down_EFD = jax.lax.all_gather(w_down_EFD, axes.embed, axis=2, tiled=True)
    experts = (w_up_EDF.astype(dt), w_gate_EDF.astype(dt), w_down_EFD.astype(dt),
               *(b.astype(dt) for b in biases[:2]))
    x_TD = x_BLD.reshape(b * length, d)
    route = route(moe, x_TD, w_router_DE, *route_state)
    y_AD, dropped_A = DISPATCHES[moe.dispatch].run(moe, axes, x_TD, route, experts, drop)
    # Back to token order and summed over each token's k choices with its router weights.
    y_TKD = y_AD[route.inverse].reshape(b * length, moe.top_k, d)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD, route.weights_TK.astype(y_TKD.dtype))
    if axes.mlp:  # tensor parallelism: each shard holds part of every expert's hidden dim
        y_TD = jax.lax.psum(y_TD, axes.mlp)
    if biases:  # each kept choice's down bias, by its router weight
        kept_TK = ~dropped_A[route.inverse].reshape(b * length, moe.top_k)
        weights_TK = jnp.where(kept_TK, route.weights_TK, 0).astype(y_TD.dtype)
        y_TD = y_TD + jnp.einsum("tk,tkd->td", weights_TK,
                                 biases[2].astype(y_TD.dtype)[route.experts_TK])
    stats = _row_stats(moe, route, dropped_A[route.inverse], b, length)
    if axes.length:
        stats = jax.tree.map(lambda s: jax.lax.psum(s, axes.length), stats)
    return y_TD.reshape(b, length, d), stats


@dataclasses.dataclass(frozen=True)
class _Route:
    logits_TE: jax.Array  # router dtype
    probs_TE: jax.Array  # float32 softmax
    experts_TK: jax.Array  # chosen experts, best first
    weights_TK: jax.Array  # their probabilities (renormalised to sum to 1: norm_topk_prob)
    order: jax.Array  # [A = T·k] the token×choice rows sorted (stably) by expert
    inverse: jax.Array  # its inverse permutation
    sizes_E: jax.Array  # rows per expert


def _route(moe: MoeSpec, x_TD, w_router_DE, b_router_E=None) -> _Route:
    """Softmax over the E logits (plus the router's bias, where the expert kind has one)
    in float32, top k, renormalised over the k with norm_topk_prob: gpt-oss's softmax of
    the k best logits is the same function."""
    rdt = moe.router_dtype
    logits_TE = jnp.dot(x_TD.astype(rdt), w_router_DE.astype(rdt))
    if b_router_E is not None:
        logits_TE = logits_TE + b_router_E.astype(rdt)
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    top_TK, experts_TK = jax.lax.top_k(probs_TE, moe.top_k)
    weights_TK = top_TK / top_TK.sum(-1, keepdims=True) if moe.norm_topk_prob else top_TK
    return sorted_route(moe, logits_TE, probs_TE, experts_TK, weights_TK)


def sorted_route(moe: MoeSpec, logits_TE, probs_TE, experts_TK, weights_TK) -> _Route:
    """A router's choices with the token×choice rows sorted by expert, as the dispatch
    paths take them."""
    expert_A = experts_TK.reshape(-1)
    order = jnp.argsort(expert_A, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    sizes_E = jnp.zeros(moe.num_experts, jnp.int32).at[expert_A].add(1)
    return _Route(logits_TE, probs_TE, experts_TK, weights_TK, order, inverse, sizes_E)


def _row_stats(moe: MoeSpec, route: _Route, dropped_A, b: int, length: int) -> dict:
    """Per sequence row: assignments per expert, router probability mass per expert, the
    sum of logsumexp² (z-loss) and the dropped assignments."""
    load_TE = jax.nn.one_hot(route.experts_TK, moe.num_experts, dtype=jnp.float32).sum(1)
    lse_T = jax.nn.logsumexp(route.logits_TE.astype(jnp.float32), axis=-1)
    per_row = lambda v: v.reshape(b, length, *v.shape[1:]).sum(1)  # noqa: E731
    return {"load": per_row(load_TE), "prob": per_row(route.probs_TE),
            "z": per_row(lse_T * lse_T),
            "dropped": per_row(dropped_A.reshape(b * length, moe.top_k).sum(1)
                               .astype(jnp.float32))}


def _expert_outputs(moe: MoeSpec, h_up, h_gate, down):
    """The expert kind's activation (SiLU(gate)·up for SwiGLU), the matmul outputs named
    for the remat policies (models/remat.py)."""
    kind = moe.kind
    a = kind.fn(kind, checkpoint_name(h_gate, "mlp_gate"), checkpoint_name(h_up, "mlp_up"))
    return checkpoint_name(down(a), "mlp_down")


def _capacity(moe: MoeSpec, axes: _Axes, x_TD, route: _Route, experts, drop: bool):
    """Sorted rows into [E, C] buffers (row c of expert e: its c-th token, if any), the
    experts as batched matmuls (after an all-to-all to the experts' shards), and back to the
    sorted rows: (y_AD in sorted order, dropped_A in sorted order)."""
    e, k = moe.num_experts, moe.top_k
    tokens = x_TD.shape[0]
    cap = moe.capacity(tokens, drop)
    rows = tokens * k
    starts_E = jnp.cumsum(route.sizes_E) - route.sizes_E
    slot_EC = starts_E[:, None] + jnp.arange(cap)[None, :]
    filled_EC = jnp.arange(cap)[None, :] < route.sizes_E[:, None]
    token_EC = route.order[jnp.minimum(slot_EC, rows - 1)] // k
    buffer_ECD = jnp.where(filled_EC[..., None], x_TD[token_EC], 0)
    shards = axes.expert_shards
    if shards > 1:  # to the devices holding the experts: [E_local, shards·C, D] there
        buffer_ECD = jax.lax.all_to_all(buffer_ECD, axes.experts, 0, 1, tiled=True)
    w_up, w_gate, w_down, *b = experts
    h_up_ECF = jnp.einsum("ecd,edf->ecf", buffer_ECD, w_up)
    h_gate_ECF = jnp.einsum("ecd,edf->ecf", buffer_ECD, w_gate)
    if b:  # the experts' up and gate biases [E_local, F]
        h_up_ECF, h_gate_ECF = h_up_ECF + b[0][:, None], h_gate_ECF + b[1][:, None]
    out_ECD = _expert_outputs(moe, h_up_ECF, h_gate_ECF,
                              lambda a: jnp.einsum("ecf,efd->ecd", a, w_down))
    if shards > 1:
        out_ECD = jax.lax.all_to_all(out_ECD, axes.experts, 1, 0, tiled=True)
    expert_A = jnp.repeat(jnp.arange(e), route.sizes_E, total_repeat_length=rows)
    position_A = jnp.arange(rows) - starts_E[expert_A]
    kept_A = position_A < cap
    y_AD = jnp.where(kept_A[:, None], out_ECD[expert_A, jnp.minimum(position_A, cap - 1)], 0)
    return y_AD, ~kept_A


def _dropless(moe: MoeSpec, axes: _Axes, x_TD, route: _Route, experts, drop: bool):
    """Sorted rows through grouped matmuls; across the expert axis, the rows for each
    device's experts are exchanged (ragged) and regrouped by local expert there. Nothing
    drops, whatever `drop` says."""
    del drop
    rows_AD = x_TD[route.order // moe.top_k]
    dropped_A = jnp.zeros(rows_AD.shape[0], bool)
    if axes.expert_shards == 1:
        return _grouped_experts(moe, rows_AD, route.sizes_E, experts), dropped_A
    return _dropless_exchanged(moe, axes, rows_AD, route.sizes_E, experts), dropped_A


def _grouped_experts(moe: MoeSpec, rows_AD, sizes_E, experts):
    """Rows sorted by expert (sizes_E of each; rows past their sum come out as zeros, or
    as the last expert's biases' output, which the caller masks)."""
    w_up, w_gate, w_down, *b = experts
    group = functools.partial(jax.lax.ragged_dot, group_sizes=sizes_E)
    h_up_AF, h_gate_AF = group(rows_AD, w_up), group(rows_AD, w_gate)
    if b:  # each row's expert's up and gate biases
        expert_A = jnp.repeat(jnp.arange(sizes_E.shape[0]), sizes_E,
                              total_repeat_length=rows_AD.shape[0])
        h_up_AF, h_gate_AF = h_up_AF + b[0][expert_A], h_gate_AF + b[1][expert_A]
    return _expert_outputs(moe, h_up_AF, h_gate_AF, lambda a: group(a, w_down))


def _exclusive_cumsum(x, axis: int = 0):
    return jnp.cumsum(x, axis=axis) - x


def _dropless_exchanged(moe: MoeSpec, axes: _Axes, rows_AD, sizes_E, experts):
    """Expert parallelism without drops. Each device sends the rows for shard j's experts
    (contiguous, since sorted by expert) to j; j receives up to shards·A rows (the worst
    case: every row of every device for its experts), packed by source, regroups them by
    its local expert for the grouped matmuls, and sends the results back the same way."""
    shards = axes.expert_shards
    local = moe.num_experts // shards
    rows, d = rows_AD.shape
    me = jax.lax.axis_index(axes.experts)
    counts_SXE = jax.lax.all_gather(sizes_E.reshape(shards, local), axes.experts)  # src, dst
    pair_SX = counts_SXE.sum(-1)  # rows from each source to each destination
    send_X, recv_S = pair_SX[me], pair_SX[:, me]
    send_offsets = _exclusive_cumsum(send_X)
    recv_offsets = _exclusive_cumsum(recv_S)
    exchange = _ragged_all_to_all if moe.ragged_collectives else _gathered_all_to_all
    capacity = shards * rows
    received_RD = exchange(rows_AD, jnp.zeros((capacity, d), rows_AD.dtype), send_offsets,
                           send_X, _exclusive_cumsum(pair_SX, 0)[me], recv_S, axes.experts)
    # Each received row's local expert: rows of source s are sorted by expert, counts_SXE.
    r = jnp.arange(capacity)
    # (A comparison count rather than jnp.searchsorted, which fails under the pipeline's
    # vmap of this shard_map in jax 0.10.2.)
    source_R = jnp.minimum((r[:, None] >= jnp.cumsum(recv_S)[None, :]).sum(-1), shards - 1)
    within_R = r - recv_offsets[source_R]
    ends_SE = jnp.cumsum(counts_SXE[:, me, :], axis=-1)
    expert_R = (within_R[:, None] >= ends_SE[source_R]).sum(-1)  # == local: padding
    expert_R = jnp.where(r < recv_S.sum(), expert_R, local)
    regroup = jnp.argsort(expert_R, stable=True)
    y_RD = _grouped_experts(moe, received_RD[regroup], counts_SXE[:, me, :].sum(0), experts)
    y_RD = jnp.zeros_like(y_RD).at[regroup].set(y_RD)
    y_RD = jnp.where((expert_R < local)[:, None], y_RD, 0)
    return exchange(y_RD, jnp.zeros((rows, d), y_RD.dtype), recv_offsets, recv_S,
                    _exclusive_cumsum(pair_SX, 1)[:, me], send_X, axes.experts)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                       recv_sizes, axis_name):
    i32 = lambda v: v.astype(jnp.int32)  # noqa: E731
    return jax.lax.ragged_all_to_all(operand, output, i32(input_offsets), i32(send_sizes),
                                     i32(output_offsets), i32(recv_sizes), axis_name=axis_name)


def _gathered_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                         recv_sizes, axis_name):
    """jax.lax.ragged_all_to_all's result from an all-gather of every device's rows (XLA:CPU
    has no ragged all-to-all): for tests and CPU runs; same offsets, same values."""
    del recv_sizes
    me = jax.lax.axis_index(axis_name)
    everyone = jax.lax.all_gather(operand, axis_name)  # [S, rows, D]
    starts_S = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    sizes_S = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    from_S = jax.lax.all_gather(input_offsets, axis_name)[:, me]
    r = jnp.arange(output.shape[0])[:, None]
    hit_RS = (r >= starts_S[None]) & (r < (starts_S + sizes_S)[None])
    source_R = jnp.argmax(hit_RS, axis=1)
    row_R = jnp.clip(from_S[source_R] + r[:, 0] - starts_S[source_R], 0, operand.shape[0] - 1)
    return jnp.where(hit_RS.any(1)[:, None], everyone[source_R, row_R], output)


def check_mesh(c, sizes: dict[str, int]) -> None:
    """What no dispatch path runs under yet: a row split over the context axis. Its
    routing statistics are per row, summed inside the layer's shard_map: a row split over
    context would report one device's share."""
    if sizes.get("context", 1) > 1:
        fail("model.moe.num_experts", c.model.moe.num_experts, f"MoE layers do not run "
             f"under mesh.context={sizes['context']} yet; use 0 (dense) or mesh.context=1")


# XLA:CPU and (by default) XLA:GPU expand ragged_dot into E dense, masked matmuls (E× the
# FLOPs: 7.3× slower than the dense matmul at 8 experts on this CPU, docs/benchmarks.md),
# so 'auto' takes the capacity path there; TPUs run ragged_dot as a grouped matmul.
DISPATCHES: dict[str, Dispatch] = {d.name: d for d in (
    Dispatch("dropless", "tokens sorted by expert, grouped matmuls (jax.lax.ragged_dot); "
             "nothing dropped", _dropless, ("tpu",), check_mesh, peer_buffers=True,
             grouped_matmuls=True),
    Dispatch("capacity", "fixed [experts, capacity] buffers and batched matmuls; tokens past "
             "an expert's capacity dropped", _capacity, ("cpu", "gpu", "*"), check_mesh,
             padded=True),
)}


def routing_losses(stats: dict, moe: MoeSpec, tokens: int) -> tuple[jax.Array, dict]:
    """(the weighted auxiliary loss to add to the objective, metrics) from per-row stats
    stacked over MoE layers ([B, layers, ...]) of a batch of `tokens` tokens.

    Load balancing (Switch/GShard): (E/k)·Σₑ fₑ·Pₑ per layer, fₑ the share of token×choice
    assignments to expert e ×k, Pₑ its mean router probability: 1.0 when balanced
    (transformers' Mixtral loss is k× this). z-loss (ST-MoE): mean logsumexp² of the router
    logits. Both averaged over the MoE layers."""
    e, k = moe.num_experts, moe.top_k
    load_NE = stats["load"].sum(0)
    share_NE, prob_NE = load_NE / tokens, stats["prob"].sum(0) / tokens
    aux = (e / k * (share_NE * prob_NE).sum(-1)).mean()
    z = (stats["z"].sum(0) / tokens).mean()
    mean_N = load_NE.mean(-1)
    metrics = {"moe_aux_loss": aux, "moe_z_loss": z,
               # The busiest and idlest expert's load over the mean, worst layer.
               "moe_load_max": (load_NE.max(-1) / mean_N).max(),
               "moe_load_min": (load_NE.min(-1) / mean_N).min(),
               "moe_dropped_fraction": stats["dropped"].sum() / (tokens * k * load_NE.shape[0])}
    return moe.aux_loss_weight * aux + moe.z_loss_weight * z, metrics
