"""Model FLOPs per token: the MFU numerator, shared by the training loop's metrics and the
planner. Counted from the model's shape alone (6 per matmul weight and token, plus causal
attention); no credit for recomputation."""

from __future__ import annotations

from jaxtrain.models.transformer import ModelSpec


def matmul_params(spec: ModelSpec) -> int:
    """Weights that take part in a token's matmuls: attention, MLP and the output head; in
    MoE layers only the active ones (router, top-k and shared experts)."""
    d, h, g, k, f = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mlp_dim
    attention = d * h * k * 2 + d * g * k * 2
    mlp = d * f * (3 if spec.gated_mlp else 2)
    moe_layers = 0 if spec.moe is None else spec.moe.layers(spec.num_layers)
    moe = 0 if spec.moe is None else moe_layers * spec.moe.active_matmul_params(d)
    return (spec.num_layers * attention + (spec.num_layers - moe_layers) * mlp + moe
            + d * spec.vocab_size)


def flops_per_token(spec: ModelSpec) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus causal attention 6·L·s·(h·k)."""
    return 6.0 * matmul_params(spec) + attention_flops_per_token(spec)


def attention_flops_per_token(spec: ModelSpec) -> float:
    """QKᵀ and PV are 2·s·h·k multiply-adds each per token forward, ×3 for backward, halved
    because the causal mask leaves half the scores. A sliding window W leaves each query
    W keys (fewer in the first W positions): W - W²/2s on average. No credit for
    recomputation.
    """
    s, w = spec.seq_len, spec.sliding_window
    keys = s / 2 if not w or w >= s else w - w * w / (2 * s)
    return 12 * spec.num_layers * keys * spec.num_heads * spec.head_dim
