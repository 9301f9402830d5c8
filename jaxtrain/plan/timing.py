"""Step time, MFU, throughput, time to train and what it costs, from the config and a
hardware entry. Formulas and sources: docs/planner.md.

Two halves:
- `step_features`: what one step asks of a device (matmul and attention FLOPs, HBM traffic,
  the bytes each mesh axis moves and over which link, collectives, pipeline bubble). Counted
  from the config; nothing here is fitted.
- `step_time`: turns features into seconds with a hardware family's calibration
  (plan/calibration.py, fitted on published training runs): achievable matmul efficiency
  and how it falls with the model width, attention kernels' relative speed, the fraction
  of the datasheet link bandwidth collectives reach and their latency, and how much of the
  data/fsdp and tensor collectives hides under compute.

Each mesh axis's traffic is one entry of AXES (its collectives per step, whether they can
overlap with compute, and where it sits from the innermost axis outwards): a new mesh axis
is a new entry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jaxtrain.mesh import batch_shards
from jaxtrain.models import ModelSpec
from jaxtrain.models.attention import KERNELS, VARIANTS
from jaxtrain.models.flops import (
    attention_flops_per_token,
    flops_per_token,
    matmul_params,
    reference_forward_flops_per_token,
)
from jaxtrain.models.remat import REMATS
from jaxtrain.objectives import OBJECTIVES, document_masks
from jaxtrain.parallel.context import imbalance
from jaxtrain.parallel.pipeline import bubble_fraction
from jaxtrain.plan import calibration as calibration_lib
from jaxtrain.plan.memory import routed_rows, value_bytes
from jaxtrain.precision import PRECISIONS

F32 = 4


def step_flops(spec: ModelSpec, tokens: int) -> dict[str, float]:
    """Model FLOPs (the MFU numerator: 6·N·tokens + causal attention) and the FLOPs the
    hardware runs, split into weight matmuls and attention: plus one more forward under full
    remat, the attention scores' forward under save_dots, and the masked half of the scores
    that the xla kernel computes."""
    model = flops_per_token(spec) * tokens
    attention = attention_flops_per_token(spec) * tokens
    weights = model - attention
    # What the remat policy recomputes (the registry's planner fact), as (fraction of the
    # weight matmuls' forward, fraction of the attention forward).
    redo_weights, redo_attention = {
        "nothing": (0.0, 0.0), "attention_scores": (0.0, 1.0),
        "forward": (1.0, 1.0)}[REMATS[spec.remat].recomputes]
    head = 6.0 * spec.d_model * spec.vocab_size * tokens  # the head is never recomputed
    hw_weights = weights + redo_weights * (weights - head) / 3
    hw_attention = attention * (1 + redo_attention / 3)
    if KERNELS[spec.attention].full_scores:
        hw_attention *= 2  # the full s×s scores, masked afterwards
    routed = 0.0
    if spec.moe is not None:
        # The experts compute every row of their buffers: capacity_factor·k per token
        # (padding included) where the model counts k; dropless, exactly k.
        moe = spec.moe
        extra = routed_rows(spec, tokens, {}) / tokens / moe.top_k - 1
        expert_flops = 6.0 * 3 * spec.d_model * moe.expert_mlp_dim * moe.top_k * tokens
        routed = (1 + extra) * expert_flops * moe.layers(spec.num_layers) * (
            1 + redo_weights / 3)
        hw_weights += extra * expert_flops * moe.layers(spec.num_layers) * (
            1 + redo_weights / 3)
    # Under an fp8 policy models/layers.dense runs the blocks' weight matmuls on fp8
    # operands; the output head (models/head_loss.py), the routed experts' einsums
    # (models/moe.py) and attention's scores and softmax stay in the compute dtype.
    low = max(0.0, hw_weights - head - routed) if spec.fp8 else 0.0
    return {"model": model, "hardware": hw_weights + hw_attention,
            "weights": hw_weights, "attention": hw_attention, "low_precision": low}


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one step's collectives on one mesh axis cost a device, before calibration."""

    bytes: float  # sent per device per step
    count: int  # collectives per step (latency)


@dataclasses.dataclass(frozen=True)
class Ctx:
    """The quantities every axis's traffic is counted from."""

    spec: ModelSpec
    sizes: dict
    micro: int  # accumulation micro-batches per step
    rows: int  # sequences per device per micro-batch
    c: int  # bytes per activation / gathered weight
    param_elems: int  # parameters held per device
    passes: int  # weight passes per micro-batch: forward, backward (+ recompute)

    @property
    def activation(self) -> float:
        """One micro-batch's residual stream on this device (its share of the sequence
        under context parallelism), bytes."""
        return self.rows * self.spec.seq_len * self.spec.d_model * self.c \
            / self.sizes.get("context", 1)


def _ring(n: int) -> float:
    """An all-gather or reduce-scatter of X moves (n−1)/n·X per device; an all-reduce 2×."""
    return (n - 1) / n


def _data(x: Ctx) -> Traffic:
    d = x.sizes["data"]
    return Traffic(2 * _ring(d) * x.param_elems * F32, 1 if d > 1 else 0)


def _fsdp(x: Ctx) -> Traffic:
    """ZeRO-3 over the group the parameters are sharded over: fsdp, and context (mesh.py's
    rules), timed on fsdp's links (the outer of the two, so the slower or the same)."""
    f = x.sizes["fsdp"] * x.sizes.get("context", 1)
    weights = x.param_elems * f  # this device's tensor/pipeline shard, gathered over fsdp
    layers = x.spec.num_layers // x.sizes["pipeline"]
    # Per micro-batch: weight all-gathers per pass in the compute dtype, a float32
    # reduce-scatter of the gradients.
    return Traffic(x.micro * _ring(f) * weights * (x.passes * x.c + F32),
                   x.micro * layers * (x.passes + 1) if f > 1 else 0)


def _tensor(x: Ctx) -> Traffic:
    t = x.sizes["tensor"]
    layers = x.spec.num_layers // x.sizes["pipeline"]
    # Two all-reduces of the block output per layer forward and two backward (+2 per
    # recompute); sequence parallelism makes each an all-gather + reduce-scatter of the
    # same bytes.
    n = x.micro * layers * x.passes * 2
    return Traffic(n * 2 * _ring(t) * x.activation, n if t > 1 else 0)


def _expert(x: Ctx) -> Traffic:
    """Per MoE layer and pass, the routed rows go to their experts and back (two
    all-to-alls; the rows staying on the device do not move); and, once a step, the
    gradients of the parameters the expert axis replicates (all but the experts: it splits
    the batch for them) are all-reduced over it."""
    e, moe = x.sizes["expert"], x.spec.moe
    if e == 1 or moe is None:
        return Traffic(0.0, 0)
    p, t, f = x.sizes["pipeline"], x.sizes["tensor"], x.sizes["fsdp"]
    layers = moe.layers(x.spec.num_layers) // p
    # The rows exchanged: the whole padded buffers, or (ragged) only the rows routed.
    rows = routed_rows(x.spec, x.rows * x.spec.seq_len, {})
    n = x.micro * layers * x.passes * 2
    exchange = n * _ring(e) * rows * x.spec.d_model * x.c
    experts_here = layers * moe.num_experts / e * 3 * x.spec.d_model * moe.expert_mlp_dim \
        / (f * t)
    shared = 2 * _ring(e) * max(0.0, x.param_elems - experts_here) * F32
    return Traffic(exchange + shared, n + 1)


def _context(x: Ctx) -> Traffic:
    """Per layer and pass every device receives the C−1 other K/V blocks of its rows
    (all-gathered, or one ppermute hop each): (C−1)/C of the row's K/V; the backward pass
    (models/attention/context.py's VJP) visits them again and sends their float32 dK/dV
    back (with the block on the ring, one reduce-scatter after the all-gather), and full
    remat gathers again. (The parameters are sharded over context as over fsdp: their
    traffic is _fsdp's.)"""
    cp, spec = x.sizes.get("context", 1), x.spec
    if cp == 1:
        return Traffic(0.0, 0)
    layers = spec.num_layers // x.sizes["pipeline"]
    kv_elems = spec.seq_len * 2 * spec.num_kv_heads * spec.head_dim / x.sizes["tensor"]
    hops = (cp - 1) if VARIANTS[spec.context.variant].hops else 1
    per_layer = x.passes * kv_elems * x.c + kv_elems * F32  # K/V each pass, dK/dV once
    n = x.micro * layers
    return Traffic(n * x.rows * _ring(cp) * per_layer, n * x.passes * hops)


def _pipeline(x: Ctx) -> Traffic:
    if x.sizes["pipeline"] == 1:
        return Traffic(0.0, 0)
    p = x.sizes["pipeline"]
    m, v = x.spec.pipeline.microbatches, x.spec.pipeline.repeats
    # Every iteration each stage passes a micro-batch on, forward and backward.
    n = x.micro * (v * m + p - 1) * 2
    return Traffic(n * x.activation / m, n)


@dataclasses.dataclass(frozen=True)
class Axis:
    traffic: Callable[[Ctx], Traffic]
    hidden: bool  # its collectives can overlap with compute (else on the critical path)


# Innermost first: an axis crosses nodes once the product of the sizes up to it exceeds a
# node. A new mesh axis (expert, context) is a new entry here, at its place in that order.
AXES: dict[str, Axis] = {
    "tensor": Axis(_tensor, hidden=False),
    # The K/V exchange feeds each layer's attention: on the critical path (the ring's hops
    # could overlap the blocks' compute; counted as exposed until measured).
    "context": Axis(_context, hidden=False),
    # The all-to-alls sit between a layer's router and its experts: on the critical path.
    "expert": Axis(_expert, hidden=False),
    "fsdp": Axis(_fsdp, hidden=True),
    "pipeline": Axis(_pipeline, hidden=False),
    "data": Axis(_data, hidden=True),
}


def axis_links(sizes: dict[str, int], hw, dcn: dict[str, int]) -> dict[str, str]:
    """'intra' or 'inter' for each mesh axis: inside a node unless the axis, counted from
    the innermost outwards, spans more devices than a node holds, or the config puts part
    of it across nodes (mesh.dcn_*)."""
    out, inner = {}, 1
    for axis in AXES:
        inner *= sizes[axis]
        crosses = inner > hw.devices_per_node or dcn.get(axis, 1) > 1
        out[axis] = "inter" if crosses and sizes[axis] > 1 else "intra"
    return out


def step_features(cfg, sizes: dict[str, int], hw, param_elems: int,
                  dcn: dict[str, int]) -> dict:
    """Everything step_time needs, counted from the config (nothing fitted)."""
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes["pipeline"],
                                 platform=hw.kind if hw.kind in ("gpu", "tpu") else "cpu",
                                 context=sizes.get("context", 1),
                                 segments=document_masks(cfg))
    n = math.prod(sizes.values())
    tokens = cfg.train.global_batch * cfg.model.seq_len
    flops = step_flops(spec, tokens)
    # An objective's reference forwards (DPO: one, no backward), which the hardware runs
    # and MFU counts (models/flops.py).
    objective = OBJECTIVES[cfg.train.objective]
    reference = objective.reference_forwards * objective.with_reference(cfg) \
        * reference_forward_flops_per_token(spec) * tokens
    share = flops["weights"] / flops["hardware"]
    flops = {**flops, "model": flops["model"] + reference,
             "hardware": flops["hardware"] + reference,
             "weights": flops["weights"] + reference * share,
             "attention": flops["attention"] + reference * (1 - share)}
    c = value_bytes(spec)
    recompute = REMATS[spec.remat].recomputes == "forward"
    micro = cfg.train.microbatches
    rows = cfg.train.global_batch // micro // batch_shards(sizes)
    ctx = Ctx(spec, sizes, micro, rows, c, param_elems, 3 if recompute else 2)
    # Roofline: each matmul streams its weights (compute dtype) once per pass and its
    # activations; memory-bound when tokens per device are few.
    tokens_dev = tokens / batch_shards(sizes)
    # (param_elems is this device's ZeRO shard: the weights it streams are the gathered ones.)
    weight_traffic = (ctx.passes + 1) * micro * param_elems * sizes["fsdp"] \
        * sizes.get("context", 1) * c
    act_traffic = (ctx.passes + 1) * tokens_dev / sizes["pipeline"] * spec.num_layers * \
        spec.d_model * 12 * c / sizes["tensor"] / sizes.get("context", 1)
    links = axis_links(sizes, hw, dcn)
    bandwidth = {"intra": hw.intra_node_gbps * 1e9, "inter": hw.inter_node_gbps * 1e9}
    axes = {}
    for name, axis in AXES.items():
        traffic = axis.traffic(ctx)
        axes[name] = {"bytes": traffic.bytes, "count": traffic.count, "link": links[name],
                      "datasheet_s": traffic.bytes / bandwidth[links[name]],
                      "hidden": axis.hidden}
    bubble = 0.0 if spec.pipeline is None else bubble_fraction(
        sizes["pipeline"], spec.pipeline.repeats, spec.pipeline.microbatches)
    return {"devices": n, "tokens_per_step": tokens, "model_flops": flops["model"],
            "hardware_flops": flops["hardware"],
            "weight_flops_per_device": flops["weights"] / n,
            "low_precision_flops_per_device": flops["low_precision"] / n,
            "attention_flops_per_device": flops["attention"] / n * _busiest(spec),
            "width": spec.d_model, "memory_bytes": weight_traffic + act_traffic,
            "axes": axes, "bubble": bubble, "matmul_params": matmul_params(spec)}


def _busiest(spec: ModelSpec) -> float:
    """The busiest device's attention work over the mean: the step waits for it. Context
    parallelism without its load balance leaves the last device ≈2× the mean."""
    if spec.context is None:
        return 1.0
    return 1.0 + imbalance(spec.context.size, spec.seq_len, spec.context.load_balance,
                           spec.sliding_window)


def peaks(hw, precision) -> dict[str, float]:
    """The dense peaks a step runs at: `base` for the compute dtype's matmuls (fp32, or bf16
    for 16-bit and fp8 policies: attention, the head, routed experts) and `low` for the
    weight matmuls a low-precision policy moves to its datasheet column (fp8); equal when
    the policy has none."""
    base = hw.peak_flops(PRECISIONS[precision.peak])
    return {"base": base, "low": hw.peak_flops(precision) if precision.fp8_matmuls else base}


def step_time(features: dict, hw, peak: dict, cal) -> dict:
    """Seconds per step and its parts, for a calibration `cal` (plan/calibration.py) and
    the peaks of `peaks()`. The low-precision matmuls reach `low_precision_efficiency` of
    the bf16 matmuls' fraction of their peak (quantize/scale work, smaller tiles: fitted on
    published fp8 runs)."""
    eff = cal.matmul_efficiency * features["width"] / (features["width"] + cal.width_knee)
    low = features.get("low_precision_flops_per_device", 0.0)
    base = features["weight_flops_per_device"] - low \
        + features["attention_flops_per_device"] / cal.attention_speed
    compute = base / (peak["base"] * eff)
    if low:
        compute += low / (peak["low"] * eff * cal.low_precision_efficiency)
    memory = features["memory_bytes"] / (hw.memory_bw_gbps * 1e9)
    busy = max(compute, memory)
    comm = {}
    for name, a in features["axes"].items():
        efficiency = cal.intra_link_efficiency if a["link"] == "intra" \
            else cal.inter_link_efficiency
        comm[name] = a["datasheet_s"] / efficiency + a["count"] * cal.collective_latency_s
    hidden = sum(comm[n] for n, a in features["axes"].items() if a["hidden"])
    exposed = sum(comm[n] for n, a in features["axes"].items() if not a["hidden"])
    # A fraction `overlap` of the shorter of compute and the hideable collectives runs
    # concurrently with the other; tensor/pipeline collectives hide `tensor_overlap`.
    step = busy + hidden - cal.overlap * min(busy, hidden) + (1 - cal.tensor_overlap) * exposed
    step /= 1 - features["bubble"]
    return {"step_s": step, "compute_s": compute, "memory_bound_s": memory,
            "matmul_efficiency": eff, "comm_s": comm,
            "bound": "compute" if compute >= memory else "memory"}


def predict(cfg, sizes: dict[str, int], hw, param_elems: int, dcn: dict[str, int],
            cal=None) -> dict:
    """Step time and its parts; param_elems: parameters held per device; cal: the
    calibration (default: the hardware's family, plan/calibration.json)."""
    cal = cal or calibration_lib.for_hardware(hw.name)
    features = step_features(cfg, sizes, hw, param_elems, dcn)
    peak = peaks(hw, PRECISIONS[cfg.train.precision])
    t = step_time(features, hw, peak, cal)
    tokens, n = features["tokens_per_step"], features["devices"]
    return {**t, "comm_bytes": {k: a["bytes"] for k, a in features["axes"].items()},
            "bubble": features["bubble"], "tokens_per_step": tokens,
            "tokens_per_s": tokens / t["step_s"],
            "model_flops_per_step": features["model_flops"],
            "hardware_flops_per_step": features["hardware_flops"],
            # MFU against the compute dtype's peak (bf16 for fp8 runs), as metrics.py.
            "mfu": features["model_flops"] / (t["step_s"] * n * peak["base"]),
            "peak_flops": peak["base"], "low_precision_peak_flops": peak["low"],
            "low_precision_share": features["low_precision_flops_per_device"]
            / (features["weight_flops_per_device"] + features["attention_flops_per_device"]),
            "matmul_params": features["matmul_params"], "calibration": cal.describe(),
            "overlap": cal.overlap_text()}


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
