"""DeepseekV3ForCausalLM (model_type deepseek_v3) <-> jaxtrain's deepseek_v3 family with
model.mla (multi-head latent attention) and model.moe (router sigmoid_bias, shared experts,
the first first_k_dense_replace layers dense).

Attention (models/mla.py), per layer: `self_attn.q_a_proj` [q_lora_rank, D] (w_q_down),
`q_a_layernorm`, `q_b_proj` [H·qk, q_lora_rank] (w_q_up), or `q_proj` [H·qk, D] (w_q) without
q_lora_rank; `kv_a_proj_with_mqa` [kv_lora_rank + rope, D] (w_kv_down), `kv_a_layernorm`;
`kv_b_proj` [H·(nope + v), kv_lora_rank], per head k_nope's rows then v's (w_k_up and w_v_up:
a tensor of H groups, HFTensor.groups); `o_proj` [D, H·v] (w_o). The rotary dims stay in
DeepSeek's interleaved order (models/mla.py de-interleaves at run time), so no row moves.

Feed-forward: layers < first_k_dense_replace are Llama's MLP of intermediate_size under
`blocks`; the rest are MoE under `moe_blocks`: `mlp.gate.weight` [E, D] (w_router),
`mlp.gate.e_score_correction_bias` [E] (float32, the router's correction bias),
`mlp.experts.{e}.{gate,up,down}_proj` of moe_intermediate_size (as transformers 5 writes
them), `mlp.shared_experts.{gate,up,down}_proj` of n_shared_experts × that width.

Multi-token prediction weights (layers past num_hidden_layers, config.json
num_nextn_predict_layers) are not read: transformers has no MTP module and ignores them too;
the import says so. RoPE is plain or YaRN (check_rope: its mscale_all_dim is
model.mla.softmax_scale). Refused: other RoPE types, attention biases, a moe_layer_freq
other than 1, topk_method other than noaux_tc.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from jaxtrain.errors import ConfigError
from jaxtrain.hf import llama
from jaxtrain.hf.mapping import Checks, HFTensor, Part, linear, one, split_heads
from jaxtrain.models.router import ROUTERS

ARCHITECTURE = "DeepseekV3ForCausalLM"
FAMILY = "deepseek_v3"
MOE = "deepseek_v3"  # with model.moe it exports as itself
SLIDING_WINDOW = False
MOE_LAYOUTS = True  # its own MoE checks (first_k_dense_replace)
SHARED_EXPERTS = True
LAYER = llama.LAYER


# config.json's defaults where transformers' config class has them (DeepseekV3Config)
DEFAULTS = {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
            "vocab_size": 129280, "intermediate_size": 18432, "rms_norm_eps": 1e-6,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
            "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "moe_layer_freq": 1}
ROUTER = "sigmoid_bias"  # model.moe.router: transformers' DeepseekV3TopkRouter


def check_config(hf: dict, m) -> list[str]:
    """Disagreements of a DeepSeek-V3 config.json with cfg.model `m`, one message each."""
    c = check_shared(hf, m, DEFAULTS, ROUTER)
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        c.refuse("topk_method", hf["topk_method"], "jaxtrain routes as noaux_tc (the "
                 "correction bias)")
    return c.problems


def _mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's 0.1·scale·ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def check_rope(c: Checks, hf: dict, m) -> None:
    """Plain RoPE, or YaRN on the rotary dims (model.rope_scaling, its attention_factor
    as transformers infers it from mscale / mscale_all_dim) with mscale_all_dim folded into
    the softmax scale (model.mla.softmax_scale = (nope + rope)^-½ · mscale(factor,
    mscale_all_dim)², transformers' yarn_apply_mscale)."""
    key, rope = llama._rope_dict(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        c.refuse(f"{key}.rope_type", kind, "the latent attention takes plain RoPE or YaRN")
        return
    c.equal("model.rope_scaling.type", m.rope_scaling.type, f"{key}.rope_type",
            {"default": "none", "yarn": "yarn"}[kind])
    if kind == "default" or m.rope_scaling.type != "yarn":
        c.equal("model.mla.softmax_scale", m.mla.softmax_scale, "(plain RoPE's)", 0.0)
        return
    ours, factor = m.rope_scaling, rope.get("factor", 1.0)
    for field, default in (("factor", 1.0), ("beta_fast", 32.0), ("beta_slow", 1.0),
                           ("truncate", True), ("original_max_position_embeddings",
                                                hf.get("max_position_embeddings"))):
        c.equal(f"model.rope_scaling.{field}", ours[field], f"{key}.{field}",
                rope.get(field, default))
    mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor") or (
        _mscale(factor, mscale) / _mscale(factor, all_dims) if mscale and all_dims
        else _mscale(factor))
    c.equal("model.rope_scaling.attention_factor (0: derived)",
            ours.attention_factor or _mscale(factor), f"{key}.attention_factor (derived)",
            attention)
    qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
    c.equal("model.mla.softmax_scale", m.mla.softmax_scale,
            f"{key}.mscale_all_dim (as the softmax scale)",
            qk ** -0.5 * _mscale(factor, all_dims) ** 2 if all_dims else 0.0)


def export_rope(spec) -> dict:
    """rope_parameters for config.json: plain, or YaRN with its attention factor and the
    softmax scale as mscale_all_dim (check_rope's inverse)."""
    s = spec.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": spec.rope_theta}
    out = {**llama.export_rope(spec), "attention_factor": s.attention_factor or _mscale(s.factor)}
    if spec.mla.softmax_scale:
        root = (spec.mla.softmax_scale * spec.mla.qk_head_dim ** 0.5) ** 0.5
        out["mscale_all_dim"] = (root - 1) / (0.1 * math.log(s.factor))
    return out


def check_shared(hf: dict, m, defaults: dict, router: str) -> Checks:
    """The checks of every MLA + MoE config.json (DeepSeek-V3, Mistral 4) but the RoPE's."""
    c = Checks()
    for ours, key in (("d_model", "hidden_size"), ("num_layers", "num_hidden_layers"),
                      ("num_heads", "num_attention_heads"), ("vocab_size", "vocab_size"),
                      ("mlp_dim", "intermediate_size"), ("norm_eps", "rms_norm_eps")):
        c.equal(f"model.{ours}", m[ours], key, hf.get(key, defaults[key]))
    c.equal("model.rope_theta", m.rope_theta, "rope_theta", llama.rope_theta(hf))
    _check_mla(c, hf, m.mla, defaults)
    _check_moe(c, hf, m, defaults, router)
    llama.check_tie(c, hf, m)
    if hf.get("hidden_act", "silu") != "silu":
        c.refuse("hidden_act", hf["hidden_act"], "the MLP is SwiGLU (silu)")
    if hf.get("attention_bias"):
        c.refuse("attention_bias", True, "jaxtrain's MLA has no biases")
    check_rope(c, hf, m)
    if m.mtp.depths:
        c.problems.append(f"model.mtp.depths={m.mtp.depths} but the import does not read "
                          "multi-token prediction weights (use 0)")
    if hf.get("num_nextn_predict_layers"):  # a note, not a refusal
        print(f"note: config.json has num_nextn_predict_layers="
              f"{hf['num_nextn_predict_layers']}: the multi-token prediction layers are not "
              "imported (transformers drops them too)", file=sys.stderr)
    return c


def _check_mla(c: Checks, hf: dict, mla, defaults: dict) -> None:
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        c.equal(f"model.mla.{key}", mla[key], key, hf.get(key, defaults[key]))
    c.equal("model.mla.q_lora_rank", mla.q_lora_rank, "q_lora_rank (null: 0)",
            hf.get("q_lora_rank", defaults["q_lora_rank"]) or 0)
    c.equal("model.mla.rope_interleave", mla.rope_interleave, "rope_interleave",
            hf.get("rope_interleave", True))


def _check_moe(c: Checks, hf: dict, m, defaults: dict, router: str) -> None:
    moe = m.moe
    c.equal("model.moe.router", moe.router, f"(the {router} router's architecture)", router)
    for ours, key, theirs in (
            ("num_experts", "n_routed_experts", moe.num_experts),
            ("top_k", "num_experts_per_tok", moe.top_k),
            ("expert_mlp_dim (0: model.mlp_dim)", "moe_intermediate_size",
             moe.expert_mlp_dim or m.mlp_dim),
            ("shared_experts", "n_shared_experts", moe.shared_experts),
            ("first_dense_layers", "first_k_dense_replace", moe.first_dense_layers),
            ("n_group", "n_group", moe.n_group), ("topk_group", "topk_group", moe.topk_group),
            ("norm_topk_prob", "norm_topk_prob", moe.norm_topk_prob),
            ("routed_scaling_factor", "routed_scaling_factor", moe.routed_scaling_factor),
            ("every_n_layers", "moe_layer_freq", moe.every_n_layers)):
        c.equal(f"model.moe.{ours}", theirs, key, hf.get(key, defaults[key]))


def _attention(spec, blocks: str) -> list[HFTensor]:
    d, h, mla = spec.d_model, spec.num_heads, spec.mla
    nope, v, r = mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    attn = f"{LAYER}self_attn."

    def heads(name, path, rows, head_dim, out=False):
        return split_heads(f"{attn}{name}.weight", (blocks, "attn", path), rows, h, head_dim,
                           transposed=True, out=out)

    if mla.q_lora_rank:
        q = [linear(f"{attn}q_a_proj.weight", (mla.q_lora_rank, d), (blocks, "attn", "w_q_down")),
             one(f"{attn}q_a_layernorm.weight", (mla.q_lora_rank,),
                 (blocks, "attn", "q_norm", "scale")),
             heads("q_b_proj", "w_q_up", mla.q_lora_rank, mla.qk_head_dim)]
    else:
        q = [heads("q_proj", "w_q", d, mla.qk_head_dim)]

    def up(name, size):  # [H·size (of this part), R] in each head's group -> [R, H, size]
        return Part((blocks, "attn", name), h * size,
                    lambda x: x.reshape(h, size, r).transpose(2, 0, 1),
                    lambda x: x.transpose(1, 2, 0).reshape(h * size, r))

    return [
        one(f"{LAYER}input_layernorm.weight", (d,), (blocks, "attn_norm", "scale")),
        *q,
        linear(f"{attn}kv_a_proj_with_mqa.weight", (r + mla.qk_rope_head_dim, d),
               (blocks, "attn", "w_kv_down")),
        one(f"{attn}kv_a_layernorm.weight", (r,), (blocks, "attn", "kv_norm", "scale")),
        HFTensor(f"{attn}kv_b_proj.weight", (h * (nope + v), r),
                 (up("w_k_up", nope), up("w_v_up", v)), groups=h),
        heads("o_proj", "w_o", d, v, out=True),
        one(f"{LAYER}post_attention_layernorm.weight", (d,), (blocks, "mlp_norm", "scale")),
    ]


def _mlp(prefix: str, path: tuple, d: int, f: int) -> list[HFTensor]:
    return [linear(f"{prefix}{name}.weight", shape, (*path, param))
            for name, shape, param in (("gate_proj", (f, d), "w_gate"),
                                       ("up_proj", (f, d), "w_up"),
                                       ("down_proj", (d, f), "w_down"))]


def _fused_experts(e: int, d: int, f: int) -> list[HFTensor]:
    """transformers' own fused layout (Mistral 4 saves it): gate_up_proj [E, 2F, D], the
    gate's F rows then the up's; down_proj [E, D, F]."""
    mlp, swap = ("moe_blocks", "mlp"), (lambda x: x.transpose(0, 2, 1))
    return [HFTensor(f"{LAYER}mlp.experts.gate_up_proj", (e, 2 * f, d),
                     (Part((*mlp, "w_gate"), f, swap, swap), Part((*mlp, "w_up"), f, swap, swap)),
                     axis=1),
            one(f"{LAYER}mlp.experts.down_proj", (e, d, f), (*mlp, "w_down"), swap, swap)]


def _experts(spec, fused: bool) -> list[HFTensor]:
    d, e, f = spec.d_model, spec.moe.num_experts, spec.moe.expert_mlp_dim
    experts = _fused_experts(e, d, f) if fused else [
        dataclasses.replace(t, experts=e)
        for t in _mlp(f"{LAYER}mlp.experts.{{e}}.", ("moe_blocks", "mlp"), d, f)]
    shared = _mlp(f"{LAYER}mlp.shared_experts.", ("moe_blocks", "mlp", "shared"), d,
                  spec.moe.shared_experts * f) if spec.moe.shared_experts else []
    bias = [one(f"{LAYER}mlp.gate.e_score_correction_bias", (e,),
                ("moe_blocks", "mlp", "e_score_correction_bias"))
            ] if spec.router is not None and ROUTERS[spec.router.name].bias else []
    return [linear(f"{LAYER}mlp.gate.weight", (e, d), ("moe_blocks", "mlp", "w_router")),
            *bias, *experts, *shared]


def tensors(spec, hf: dict | None = None, fused: bool = False) -> list[HFTensor]:
    """The checkpoint's tensors, in file order. On import (`hf` given) a tied head is read
    from the embedding table. fused: the experts as transformers' fused tensors (else one
    tensor per expert and projection, as transformers 5 writes DeepSeek-V3's)."""
    d, v = spec.d_model, spec.vocab_size
    first = spec.moe.first_dense_layers
    dense, moe = tuple(range(first)), tuple(range(first, spec.num_layers))
    layered = [dataclasses.replace(t, layers=moe)
               for t in _attention(spec, "moe_blocks") + _experts(spec, fused)]
    if dense:
        layered += [dataclasses.replace(t, layers=dense) for t in _attention(spec, "blocks")
                    + _mlp(f"{LAYER}mlp.", ("blocks", "mlp"), d, spec.mlp_dim)]
    return [one("model.embed_tokens.weight", (v, d), ("tok_embed",)), *layered,
            one("model.norm.weight", (d,), ("final_norm", "scale")),
            *llama.head_tensors(spec, hf)]


def export_config(spec) -> dict:
    return {**export_shared(spec, ARCHITECTURE, ROUTER), "model_type": "deepseek_v3",
            "topk_method": "noaux_tc", "num_mtp_layers": 0, "rope_parameters": export_rope(spec)}


def export_shared(spec, architecture: str, router_name: str) -> dict:
    """The config.json keys every MLA + MoE architecture shares; ConfigError (one line)
    for a model it cannot express, before anything is written."""
    mla, moe, router = spec.mla, spec.moe, spec.router
    if mla is None or moe is None or router is None or router.name != router_name:
        raise ConfigError(f"a {spec.family} model exports as {architecture} only with "
                          "model.mla.kv_lora_rank, model.moe.num_experts and "
                          f"model.moe.router={router_name!r} set")
    return {
        "architectures": [architecture],
        "vocab_size": spec.vocab_size, "hidden_size": spec.d_model,
        "intermediate_size": spec.mlp_dim, "moe_intermediate_size": moe.expert_mlp_dim,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads, "n_shared_experts": moe.shared_experts,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "routed_scaling_factor": router.routed_scaling_factor, "n_group": router.n_group,
        "topk_group": router.topk_group, "norm_topk_prob": router.norm_topk_prob,
        "first_k_dense_replace": moe.first_dense_layers,
        "moe_layer_freq": 1, "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank or None, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
        "rope_interleave": mla.rope_interleave, "hidden_act": "silu",
        "max_position_embeddings": spec.seq_len, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta, "attention_bias": False,
        "tie_word_embeddings": spec.tied_embeddings,
        "initializer_range": spec.init_std, "bos_token_id": None, "eos_token_id": None,
    }

