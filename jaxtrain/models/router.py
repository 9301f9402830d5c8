"""MoE routers (`model.moe.router`, one ROUTERS entry each) and DeepSeek-V3's MoE layer.

- softmax: Mixtral's softmax top-k, renormalised over the k picked (models/moe.py `_route`,
  unchanged: the Mixtral path is bitwise what it was).
- softmax_group: Mistral 4's (transformers' Mistral4TopkRouter): sigmoid_bias's choice on
  softmax probabilities, without a bias.
- sigmoid_bias: DeepSeek-V3's (transformers' DeepseekV3TopkRouter). Each expert's affinity
  is sigmoid(x·w_e) in float32. The choice adds a per-expert correction bias (float32) to
  the affinities and, with `n_group` groups, first keeps the `topk_group` groups whose two
  best biased affinities sum highest; the top k of the kept experts are chosen. Their
  weights are the *unbiased* affinities, renormalised when `norm_topk_prob`, times
  `routed_scaling_factor`.

Aux-loss-free balancing (DeepSeek-V3 report, §2.1.2): the bias is state, not a trained
parameter: no gradient reaches it (it only picks experts, and is stopped besides) and
whatever the optimizer makes of its zero gradient is replaced. After each step every
expert's bias moves by γ (`bias_update_rate`) toward balance: down by γ when the step gave
the expert more than the mean load of its layer, up by γ when less (`updated_bias`, applied
by the train step through `bias_update`). The loads are the step's global batch sums
(routing statistics, models/moe.py STAT_NAMES "load"), so every replica computes the same
bias. It rides in the parameter tree (a CorrectionBias, an nnx.Param kind) so that it is
sharded, checkpointed, merged, imported and exported with the weights it belongs to.

`DeepSeekMoe` is models/moe.py's `MoeMlp` (its experts, dispatch paths, expert parallelism
and shared experts: `n_shared_experts` always-on experts of `moe_intermediate_size`, run as
one SwiGLU of n_shared × that width, as transformers does) with this router and its bias.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import fail
from jaxtrain.models import moe as moe_lib


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """The router's settings, resolved once (the module docstring has the fields)."""

    name: str = "softmax"
    n_group: int = 1  # 1: no group limit
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    bias_update_rate: float = 0.001  # γ

    @classmethod
    def from_config(cls, moe) -> RouterSpec:
        return cls(**{f.name: moe[f.name] for f in dataclasses.fields(cls) if f.name != "name"},
                   name=moe.router)


@dataclasses.dataclass(frozen=True)
class Router:
    """One `model.moe.router` value: its routing function, its check and its facts."""

    name: str
    doc: str
    # (router spec, moe spec, x_TD, w_router_DE, *state) -> models/moe.py _Route
    route: Callable
    check: Callable | None = None  # (config) -> None, raising ConfigError
    # It carries a per-expert correction bias (state, updated between steps, checkpointed).
    bias: bool = False
    # Planner: per-token router FLOPs beyond the D×E matmul, per expert (sigmoid, bias,
    # group scores): small, counted so the router's cost is a fact, not a guess.
    extra_flops_per_expert: int = 0


def defaults() -> dict:
    """The router's keys of the `model.moe` section (transformers' names where it has them)."""
    return {
        # softmax (Mixtral), sigmoid_bias (DeepSeek-V3) or softmax_group (Mistral 4)
        "router": "softmax",
        "n_group": 1,  # sigmoid_bias: experts split into groups for the group limit
        "topk_group": 1,  # ... of which each token's experts come from the best topk_group
        "norm_topk_prob": True,  # renormalise the k picked weights to sum to 1
        "routed_scaling_factor": 1.0,  # the routed experts' output multiplier
        "bias_update_rate": 0.001,  # γ of the aux-loss-free bias update (0: frozen bias)
    }


def _softmax(r: RouterSpec, moe, x_TD, w_router_DE):
    del r
    return moe_lib._route(moe, x_TD, w_router_DE)


def group_mask(choice_TE: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Bool [T, E]: the experts of each token's `topk_group` best groups, a group scored by
    the sum of its two best (biased) affinities, as DeepSeek-V3 and transformers do."""
    t, e = choice_TE.shape
    best2_TG = jax.lax.top_k(choice_TE.reshape(t, n_group, e // n_group), 2)[0].sum(-1)
    _, groups_TK = jax.lax.top_k(best2_TG, topk_group)
    kept_TG = jax.nn.one_hot(groups_TK, n_group, dtype=jnp.int32).sum(1) > 0
    return jnp.repeat(kept_TG, e // n_group, axis=1)


def _chosen(r: RouterSpec, moe, logits_TE, scores_TE, choice_TE):
    """The shared end of the group-limited routers: the top k of `choice` within each
    token's topk_group best groups, weighted by their `scores` (renormalised with
    norm_topk_prob, times routed_scaling_factor), as a sorted route whose aux statistics
    are the scores normalised per token."""
    if r.n_group > 1:
        choice_TE = jnp.where(group_mask(choice_TE, r.n_group, r.topk_group), choice_TE,
                              -jnp.inf)
    _, experts_TK = jax.lax.top_k(choice_TE, moe.top_k)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if r.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    probs_TE = scores_TE / scores_TE.sum(-1, keepdims=True)
    return moe_lib.sorted_route(moe, logits_TE, probs_TE, experts_TK,
                                weights_TK * r.routed_scaling_factor)


def _sigmoid_bias(r: RouterSpec, moe, x_TD, w_router_DE, bias_E):
    """DeepSeek-V3's choice (module docstring): on the affinities plus the bias, weighted
    by the unbiased affinities; the aux statistics are the affinities normalised per token,
    as the report's sequence-wise balance loss forms them."""
    logits_TE = jnp.dot(x_TD.astype(jnp.float32), w_router_DE.astype(jnp.float32))
    scores_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = scores_TE + jax.lax.stop_gradient(bias_E).astype(jnp.float32)
    return _chosen(r, moe, logits_TE, scores_TE, choice_TE)


def _softmax_group(r: RouterSpec, moe, x_TD, w_router_DE):
    """Mistral 4's choice (transformers' Mistral4TopkRouter): DeepSeek-V3's group-limited
    top k and scaled weights, on softmax probabilities and without a correction bias."""
    logits_TE = jnp.dot(x_TD.astype(moe.router_dtype), w_router_DE.astype(moe.router_dtype))
    scores_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    return _chosen(r, moe, logits_TE, scores_TE, scores_TE)


def _check_sigmoid_bias(c) -> None:
    moe = c.model.moe
    e, g = moe.num_experts, moe.n_group
    if g < 1 or e % g or (g > 1 and e // g < 2):
        fail("model.moe.n_group", g, f"must divide model.moe.num_experts={e} into groups of "
             "at least 2 experts (a group's score is its two best), or be 1")
    if not 1 <= moe.topk_group <= g:
        fail("model.moe.topk_group", moe.topk_group, f"must be between 1 and "
             f"model.moe.n_group={g}")
    if moe.top_k > moe.topk_group * (e // g):
        fail("model.moe.top_k", moe.top_k, f"must be at most the kept groups' experts, "
             f"topk_group×num_experts/n_group={moe.topk_group * (e // g)}")
    if moe.routed_scaling_factor <= 0:
        fail("model.moe.routed_scaling_factor", moe.routed_scaling_factor, "must be > 0")
    if moe.bias_update_rate < 0:
        fail("model.moe.bias_update_rate", moe.bias_update_rate, "must be >= 0")


ROUTERS: dict[str, Router] = {r.name: r for r in (
    Router("softmax", "Mixtral: softmax top-k renormalised over the k picked", _softmax),
    Router("sigmoid_bias", "DeepSeek-V3: sigmoid affinities, a correction bias balanced "
           "without an aux loss, group-limited choice", _sigmoid_bias, _check_sigmoid_bias,
           bias=True, extra_flops_per_expert=4),
    Router("softmax_group", "Mistral 4: softmax probabilities, group-limited choice, scaled "
           "weights; no correction bias", _softmax_group, _check_sigmoid_bias,
           extra_flops_per_expert=2),
)}


def check(c) -> None:
    """ConfigError for a router setting that cannot work (for config.validate)."""
    name = c.model.moe.router
    if name not in ROUTERS:
        fail("model.moe.router", name, f"valid values are {', '.join(ROUTERS)}")
    if ROUTERS[name].check is not None:
        ROUTERS[name].check(c)


def updated_bias(bias_NE: jax.Array, load_NE: jax.Array, rate: float) -> jax.Array:
    """The correction bias after a step (DeepSeek-V3 report §2.1.2): each expert's moves by
    −γ when its layer's step load is above the layer's mean, +γ when below, 0 when equal.
    load_NE: token×choice assignments per MoE layer and expert, the global batch's sums (so
    every replica gets the same bias). float32, outside the gradient."""
    load_NE = load_NE.astype(jnp.float32)
    mean_N1 = load_NE.mean(-1, keepdims=True)
    return (bias_NE.astype(jnp.float32) + rate * jnp.sign(mean_N1 - load_NE)).astype(
        jnp.float32)


class CorrectionBias(nnx.Param):
    """The router's per-expert correction bias: a Param kind only so that it travels with
    the weights (module docstring); the step sets it by `updated_bias`, never by the
    optimizer."""


# The forward pass's metric holding the step's expert loads [MoE layers, E] (taken out of
# the logged metrics by the step).
EXPERT_LOAD = "moe_expert_load"


def bias_update(spec) -> Callable | None:
    """The step's hook for a router with a bias: (params before the step, params after
    the optimizer, the forward's metrics) -> (params, metrics), the bias moved by
    `updated_bias` from the step's loads and the loads taken out of the metrics; None for a
    router without one."""
    if spec.router is None or not ROUTERS[spec.router.name].bias:
        return None
    rate = spec.router.bias_update_rate

    def update(old: dict, params: dict, metrics: dict):
        metrics = dict(metrics)
        load_NE = metrics.pop(EXPERT_LOAD)
        mlp = params.get("moe_blocks", {}).get("mlp", {})
        if "e_score_correction_bias" not in mlp:  # LoRA: in the frozen base, kept as is
            return params, metrics
        new = updated_bias(old["moe_blocks"]["mlp"]["e_score_correction_bias"], load_NE, rate)
        mlp = {**mlp, "e_score_correction_bias": new}
        return {**params, "moe_blocks": {**params["moe_blocks"], "mlp": mlp}}, metrics

    return update


class DeepSeekMoe(moe_lib.MoeMlp):
    """MoeMlp (router weight, E experts, shared experts) routed by a ROUTERS entry; a
    router with a bias holds it as `e_score_correction_bias` [E] float32 (transformers'
    name). __call__(x_BLD, drop) -> (y_BLD, per-row routing stats)."""

    def __init__(self, spec, router: RouterSpec, *, rngs: nnx.Rngs):
        super().__init__(spec, rngs=rngs)
        self.router = router
        if ROUTERS[router.name].bias:
            self.e_score_correction_bias = CorrectionBias(
                jnp.zeros(spec.moe.num_experts, jnp.float32), axes=(None,))

    def __call__(self, x_BLD: jax.Array, drop: bool = True):
        spec, entry = self.spec, ROUTERS[self.router.name]
        weights = (self.w_router[...], *(self._expert_weight(n) for n in ("up", "gate", "down")))
        state = (self.e_score_correction_bias[...],) if entry.bias else ()
        y_BLD, stats = moe_lib.routed_experts(
            spec, x_BLD, weights, drop, functools.partial(entry.route, self.router), state)
        if spec.moe.shared_experts:
            y_BLD = y_BLD + self.shared(x_BLD)
        return y_BLD, stats
