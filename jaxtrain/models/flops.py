"""Model FLOPs per token: the MFU numerator, shared by the training loop's metrics and the
planner. Counted from the model's shape alone (6 per trained matmul weight and token: the
forward, the input's gradient and the weight's; 4 per frozen one, whose weight gradient is
never formed; plus causal attention), plus the forward passes of a frozen reference model an
objective runs (DPO: 2 per weight and token, the attention's forward); no credit for
recomputation."""

from __future__ import annotations

import collections

from jaxtrain.models.mla import MLA
from jaxtrain.models.transformer import ModelSpec


def matmul_params(spec: ModelSpec) -> int:
    """Weights that take part in a token's matmuls: attention, MLP and the output head; in
    MoE layers only the active ones (router, top-k and shared experts)."""
    d, h, g, k, f = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mlp_dim
    attention = d * h * k * 2 + d * g * k * 2
    if spec.mla is not None:  # the latent attention's own fact (models/mla.py)
        attention = MLA.matmul_params(spec.mla, d, h)
    mlp = d * f * (3 if spec.gated_mlp else 2)
    moe_layers = 0 if spec.moe is None else spec.moe.layers(spec.num_layers)
    moe = 0 if spec.moe is None else moe_layers * spec.moe.active_matmul_params(d)
    # Multi-token prediction: each depth's projection and dense block, and the shared head
    # once more (models/mtp.py's fact).
    mtp = 0 if spec.mtp is None else (spec.mtp.matmul_params(d, attention + mlp)
                                      + spec.mtp.depths * d * spec.vocab_size)
    linear = linear_layers(spec)  # Gated DeltaNet layers: their own projections
    mixers = (spec.num_layers - linear) * attention + (
        linear * spec.linear.matmul_params(d) if linear else 0)
    return (mixers + (spec.num_layers - moe_layers) * mlp + moe
            + d * spec.vocab_size + mtp)


def linear_layers(spec: ModelSpec) -> int:
    """The model's linear-attention (Gated DeltaNet) layers."""
    return sum(spec.layer_kind(k).linear for k in spec.layer_types)


def flops_per_token(spec: ModelSpec, reference_forwards: int = 0) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus causal attention 6·L·s·(h·k).
    Under LoRA the base is frozen: 4 per base weight (no weight gradient; the routed
    experts' 6 when `experts` is targeted, since their adapters are folded into the weights
    and the full gradient is formed), plus 6 per adapter weight. Plus `reference_forwards`
    forward passes of the frozen reference model (objectives.py Objective.reference_forwards:
    DPO's frozen copy, or LoRA's base), which the step runs too."""
    return (_trained_flops_per_token(spec)
            + reference_forwards * reference_forward_flops_per_token(spec))


def reference_forward_flops_per_token(spec: ModelSpec) -> float:
    """One forward pass of the model without adapters: 2 per matmul weight, plus the
    forward third of the causal attention."""
    return 2.0 * matmul_params(spec) + attention_flops_per_token(spec) / 3


def _trained_flops_per_token(spec: ModelSpec) -> float:
    if spec.lora is None:
        return 6.0 * matmul_params(spec) + attention_flops_per_token(spec)
    gradient_formed = 0
    if spec.lora.adapts("experts", "w_up") and spec.moe is not None:
        gradient_formed = spec.moe.layers(spec.num_layers) * spec.moe.active_matmul_params(
            spec.d_model)
    return (4.0 * matmul_params(spec) + 2.0 * gradient_formed
            + 6.0 * lora_adapter_params(spec) + attention_flops_per_token(spec))


def lora_adapter_params(spec: ModelSpec) -> int:
    """Adapter weights a token's matmuls go through (rank·(fan_in + fan_out) per adapted
    dense weight and layer; expert adapters are folded into their weights, so none)."""
    d, h, g, k, f = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mlp_dim
    sizes = {("attention", "w_q"): d + h * k, ("attention", "w_k"): d + g * k,
             ("attention", "w_v"): d + g * k, ("attention", "w_o"): h * k + d,
             ("mlp", "w_up"): d + f, ("mlp", "w_gate"): d + f, ("mlp", "w_down"): f + d}
    dense_mlp_layers = spec.num_layers - (0 if spec.moe is None
                                          else spec.moe.layers(spec.num_layers))
    layers = {"attention": spec.num_layers, "mlp": dense_mlp_layers}
    return spec.lora.rank * sum(size * layers[module] for (module, weight), size
                                in sizes.items() if spec.lora.adapts(module, weight))


def attention_flops_per_token(spec: ModelSpec) -> float:
    """QKᵀ and PV are 2·s·h·k multiply-adds each per token forward, ×3 for backward, halved
    because the causal mask leaves half the scores. A sliding window W leaves each query
    W keys (fewer in the first W positions): W - W²/2s on average, each layer by its kind's
    fact (models/families.py LAYER_KINDS keys_per_query). No credit for recomputation.
    """
    counts = collections.Counter(spec.layer_types or (None,) * spec.num_layers)
    if spec.mtp is not None:  # each MTP depth's block attends as a uniform layer
        counts[None] += spec.mtp.depths
    if spec.mla is not None:  # QKᵀ over q/k's head dim, PV over v's (models/mla.py)
        return sum(3 * n * spec.mla.score_flops_per_token(
            spec.num_heads, spec.layer_kind(kind).keys_per_query(spec))
            for kind, n in counts.items())
    # Gated DeltaNet layers see no keys; their delta rule, forward and backward (×3).
    delta = 3 * linear_layers(spec) * spec.linear.delta_rule_flops_per_token() \
        if spec.linear is not None else 0.0
    return delta + sum(12 * n * spec.layer_kind(kind).keys_per_query(spec) * spec.num_heads
                       * spec.head_dim for kind, n in counts.items())
