"""MixtralForCausalLM <-> jaxtrain's llama family with model.moe (every layer MoE, no shared
experts).

Attention, norms, embeddings and head are Llama's (llama.py), under `moe_blocks`. The MoE
block is stored as the Hub's Mixtral checkpoints keep it (and transformers 5 still writes
it): `block_sparse_moe.gate.weight` [E, D] (jaxtrain's router w_router [D, E]) and per
expert `experts.{e}.w1` (gate), `w3` (up) [F, D] and `w2` (down) [D, F], stacked here as
[layers, E, D, F] and [layers, E, F, D]. The routing is the same function: softmax over the
E router logits in float32, top k, weights renormalised over the k. config.json's
sliding_window (null: none) is model.sliding_window (0: none), both ways: the same window.
"""

from __future__ import annotations

import dataclasses

from jaxtrain.hf import llama
from jaxtrain.hf.mapping import HFTensor, linear

ARCHITECTURE = "MixtralForCausalLM"
FAMILY = "llama"  # the jaxtrain model.family it imports into
SLIDING_WINDOW = True  # config.json sliding_window (null: none) is model.sliding_window (0)
PEFT_LAYOUT = True  # separate q/k/v/o and gate/up/down projections, as PEFT names them


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a Mixtral config.json with cfg.model `m`, one message each."""
    c = llama.check_shared(hf, m)
    moe = m.moe
    c.equal("model.moe.expert_mlp_dim (0: model.mlp_dim)", moe.expert_mlp_dim or m.mlp_dim,
            "intermediate_size", hf.get("intermediate_size", 14336))
    c.equal("model.moe.num_experts", moe.num_experts, "num_local_experts",
            hf.get("num_local_experts", 8))
    c.equal("model.moe.top_k", moe.top_k, "num_experts_per_tok", hf.get("num_experts_per_tok", 2))
    if moe.every_n_layers != 1:
        c.problems.append(f"model.moe.every_n_layers={moe.every_n_layers} but every Mixtral "
                          "layer is MoE (use 1)")
    if moe.shared_experts:
        c.problems.append(f"model.moe.shared_experts={moe.shared_experts} but Mixtral has "
                          "no shared experts (use 0)")
    # transformers' window is what jaxtrain's is: query i sees keys (i - W, i].
    window = hf.get("sliding_window")
    c.derive("model.sliding_window", window or 0)
    if (m.sliding_window or None) != window:
        c.problems.append(f"model.sliding_window={m.sliding_window} but config.json "
                          f"sliding_window={window} (0 is null: full causal attention)")
    if not moe.norm_topk_prob:
        c.problems.append("model.moe.norm_topk_prob=False but Mixtral renormalises the k "
                          "picked weights (use True)")
    if hf.get("router_jitter_noise", 0.0):
        c.refuse("router_jitter_noise", hf["router_jitter_noise"],
                 "jaxtrain's router has no input jitter")
    return c.problems


def tensors(spec, hf: dict | None = None) -> list[HFTensor]:
    d, e, f = spec.d_model, spec.moe.num_experts, spec.moe.expert_mlp_dim
    moe = f"{llama.LAYER}block_sparse_moe."

    def expert(name, out_in, param):
        return dataclasses.replace(
            linear(f"{moe}experts.{{e}}.{name}.weight", out_in, ("moe_blocks", "mlp", param)),
            experts=e)

    return llama.around_mlp(spec, hf, "moe_blocks", [
        linear(f"{moe}gate.weight", (e, d), ("moe_blocks", "mlp", "w_router")),
        expert("w1", (f, d), "w_gate"),
        expert("w2", (d, f), "w_down"),
        expert("w3", (f, d), "w_up"),
    ])


def export_config(spec) -> dict:
    moe = spec.moe
    return {
        **llama.export_config(spec),
        "architectures": [ARCHITECTURE], "model_type": "mixtral",
        "intermediate_size": moe.expert_mlp_dim, "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k, "router_jitter_noise": 0.0,
        "output_router_logits": False, "sliding_window": spec.sliding_window or None,
        # transformers' load-balancing loss is top_k × jaxtrain's (models/moe.py).
        "router_aux_loss_coef": moe.aux_loss_weight / moe.top_k,
    }
