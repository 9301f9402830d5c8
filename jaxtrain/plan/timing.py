"""Step time, MFU, throughput, time to train and what it costs, from the config and a
hardware entry. Formulas and sources: docs/planner.md.

Stated assumptions (printed with every plan):
- matmuls reach MATMUL_EFFICIENCY of the dense peak when compute-bound (roofline otherwise);
- data and fsdp collectives overlap with compute (only the part longer than compute shows);
  tensor and pipeline collectives sit on the critical path and add to the step;
- an axis whose devices span more than one node runs at the inter-node bandwidth.
"""

from __future__ import annotations

import math

from jaxtrain.models import ModelSpec
from jaxtrain.models.flops import attention_flops_per_token, flops_per_token, matmul_params
from jaxtrain.plan.memory import value_bytes
from jaxtrain.parallel.pipeline import bubble_fraction

MATMUL_EFFICIENCY = 0.7
OVERLAP = ("data and fsdp collectives overlap with compute; tensor and pipeline "
           "collectives add to the step")
F32 = 4


def step_flops(spec: ModelSpec, tokens: int) -> dict[str, float]:
    """Model FLOPs (the MFU numerator: 6·N·tokens + causal attention) and the FLOPs the
    hardware runs: plus one more forward under full remat, the attention scores' forward
    under save_dots, and the masked half of the scores that the xla kernel computes."""
    model = flops_per_token(spec) * tokens
    attention = attention_flops_per_token(spec) * tokens
    forward = model / 3
    recompute = {"none": 0.0, "full": forward, "save_dots": attention / 3 * 2,
                 # finer policies: modelled as their nearest coarse one
                 "save_dots_except_mlp": attention / 3 * 2, "save_attention_out": forward,
                 "offload_dots": 0.0}[spec.remat]
    return {"model": model, "hardware": model + attention + recompute}


def axis_bandwidths(sizes: dict[str, int], hw, dcn: dict[str, int]) -> dict[str, float]:
    """Bytes/s per device for each mesh axis: inside a node unless the axis, counted from
    the innermost (tensor) outwards, spans more devices than a node holds, or the config
    puts part of it across nodes (mesh.dcn_*)."""
    out, inner = {}, 1
    for axis in ("tensor", "fsdp", "pipeline", "data"):
        inner *= sizes[axis]
        crosses = inner > hw.devices_per_node or dcn.get(axis, 1) > 1
        out[axis] = (hw.inter_node_gbps if crosses and sizes[axis] > 1
                     else hw.intra_node_gbps) * 1e9
    return out


def comm_bytes(cfg, spec: ModelSpec, sizes: dict[str, int], param_elems: int) -> dict:
    """Bytes each device sends per step on each axis (ring collectives: an all-gather or
    reduce-scatter of X moves (n−1)/n·X, an all-reduce twice that)."""
    c = value_bytes(spec)
    d, t, f, p = sizes["data"], sizes["tensor"], sizes["fsdp"], sizes["pipeline"]
    micro = cfg.train.microbatches
    rows = cfg.train.global_batch // micro // (d * f)
    weights = param_elems * f  # this device's tensor/pipeline shard, gathered over fsdp
    ring = lambda n: (n - 1) / n  # noqa: E731
    passes = 3 if spec.remat in ("full", "save_attention_out") else 2  # weight gathers: forward, backward, recompute
    out = {"data": 2 * ring(d) * param_elems * F32,  # gradient all-reduce, once per step
           "fsdp": micro * ring(f) * weights * (passes * c + F32),  # gathers + reduce-scatter
           "tensor": 0.0, "pipeline": 0.0}
    layers = spec.num_layers / p
    activation = rows * spec.seq_len * spec.d_model * c
    # Two all-reduces of the block output per layer forward and two backward (+2 recompute);
    # sequence parallelism makes each an all-gather + reduce-scatter of the same bytes.
    out["tensor"] = micro * layers * (passes * 2) * 2 * ring(t) * activation
    if p > 1:
        m, v = spec.pipeline.microbatches, spec.pipeline.repeats
        # Every iteration each stage passes a micro-batch on, forward and backward.
        out["pipeline"] = micro * (v * m + p - 1) * 2 * activation / m
    return out


def predict(cfg, sizes: dict[str, int], hw, param_elems: int, dcn: dict[str, int]) -> dict:
    """Step time and its parts; param_elems: parameters held per device."""
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes["pipeline"])
    n = math.prod(sizes.values())
    tokens = cfg.train.global_batch * cfg.model.seq_len
    flops = step_flops(spec, tokens)
    peak = hw.peak_flops(cfg.train.precision)
    compute = flops["hardware"] / n / (peak * MATMUL_EFFICIENCY)
    # Roofline: each matmul streams its weights (compute dtype) once per pass and its
    # activations; memory-bound when tokens per device are few.
    c = value_bytes(spec)
    passes = 4 if spec.remat in ("full", "save_attention_out") else 3
    tokens_dev = tokens / (sizes["data"] * sizes["fsdp"])
    weight_traffic = passes * cfg.train.microbatches * param_elems * sizes["fsdp"] * c
    act_traffic = passes * tokens_dev / sizes["pipeline"] * spec.num_layers * \
        spec.d_model * 12 * c / sizes["tensor"]
    memory = (weight_traffic + act_traffic) / (hw.memory_bw_gbps * 1e9)
    busy = max(compute, memory)
    bw = axis_bandwidths(sizes, hw, dcn)
    traffic = comm_bytes(cfg, spec, sizes, param_elems)
    comm = {axis: traffic[axis] / bw[axis] for axis in traffic}
    overlapped = max(busy, comm["data"] + comm["fsdp"])
    exposed = comm["tensor"] + comm["pipeline"]
    bubble = 0.0 if spec.pipeline is None else bubble_fraction(
        sizes["pipeline"], spec.pipeline.repeats, spec.pipeline.microbatches)
    step = (overlapped + exposed) / (1 - bubble)
    return {"step_s": step, "compute_s": compute, "memory_bound_s": memory,
            "comm_s": comm, "comm_bytes": traffic, "bubble": bubble,
            "bound": "compute" if compute >= memory else "memory",
            "tokens_per_step": tokens, "tokens_per_s": tokens / step,
            "model_flops_per_step": flops["model"],
            "hardware_flops_per_step": flops["hardware"],
            "mfu": flops["model"] / (step * n * peak), "peak_flops": peak,
            "matmul_params": matmul_params(spec), "overlap": OVERLAP,
            "matmul_efficiency": MATMUL_EFFICIENCY}


def cost(hours: float, devices: int, hw, price_per_hour: float | None = None,
         power_price: float = 0.15, amortize_years: float = 5.0) -> dict:
    """Cloud cost (price_per_hour: for all devices together; default the catalog's
    per-device price × devices), accelerator energy, and on-premise cost: the purchase
    amortized over amortize_years plus the energy at power_price $/kWh."""
    cluster_price = price_per_hour if price_per_hour is not None else (
        hw.cloud_usd_per_hour * devices if hw.cloud_usd_per_hour is not None else None)
    energy_kwh = devices * hw.power_w * hours / 1000
    on_prem = None
    if hw.purchase_usd is not None:
        on_prem = (hw.purchase_usd * devices * hours / (amortize_years * 365 * 24)
                   + energy_kwh * power_price)
    return {"hours": hours, "days": hours / 24, "cloud_usd_per_hour": cluster_price,
            "cloud_usd": None if cluster_price is None else cluster_price * hours,
            "energy_kwh": energy_kwh, "power_usd_per_kwh": power_price,
            "amortize_years": amortize_years, "on_prem_usd": on_prem}
