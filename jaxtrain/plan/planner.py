"""One plan: memory, time and cost of a config on N devices of one hardware entry."""

from __future__ import annotations

from jaxtrain.config import dcn_shape, validate
from jaxtrain.models import ModelSpec
from jaxtrain.plan import checkpoint_io, decode, memory, memory_fit, timing

# What a device can give the step: CUDA/ROCm context, XLA's own reserve and fragmentation
# take the rest (on GPUs also raise XLA_PYTHON_CLIENT_MEM_FRACTION from its 0.75 default).
USABLE_FRACTION = 0.9


def make_plan(cfg, hw, devices: int, tokens: float | None = None, hours: float | None = None,
              price_per_hour: float | None = None, power_price: float = 0.15,
              amortize_years: float = 5.0, usable_fraction: float = USABLE_FRACTION) -> dict:
    """Raises ConfigError (one line) when the config cannot run on that many devices."""
    sizes = validate(cfg, devices)
    platform = hw.kind if hw.kind in ("gpu", "tpu") else "cpu"
    mem = memory.estimate(cfg, sizes, platform=platform)
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes["pipeline"],
                                 context=sizes["context"])
    shards = memory.param_shards(spec, sizes)
    time = timing.predict(cfg, sizes, hw, shards["total"], dcn_shape(cfg.mesh))
    usable = hw.memory_bytes * usable_fraction
    plan = {"config": cfg.name, "hardware": hw.name, "devices": devices, "mesh": sizes,
            "params": shards["count"], "active_params": active_params(cfg, shards["count"]),
            "memory": {"total_bytes_per_device": mem["total"],
                       "parts": {k: v for k, v in mem.items() if k != "total"},
                       "device_bytes": hw.memory_bytes, "usable_bytes": usable,
                       "fits": mem["total"] <= usable,
                       "uncertainty": memory.uncertainty(platform),
                       "known_gap": memory_fit.known_gap(spec)},
            "time": time,
            "checkpoint": checkpoint_io.checkpoint_io(cfg, sizes, devices, hw.host_devices),
            "decode": decode.decode_plan(cfg, sizes, hw, usable)}
    if tokens is None and hours is None:
        return plan
    if tokens is not None:
        hours = tokens / time["tokens_per_s"] / 3600
    else:
        tokens = hours * 3600 * time["tokens_per_s"]
    plan["time"] = {**time, "train_tokens": tokens, "train_hours": hours,
                    "train_days": hours / 24, "train_steps": tokens / time["tokens_per_step"]}
    plan["cost"] = timing.cost(hours, devices, hw, price_per_hour, power_price,
                               amortize_years)
    return plan


def active_params(cfg, total: int) -> int:
    """Parameters a token uses: all, less the experts it is not routed to (MoE)."""
    moe = cfg.model.moe
    if not moe.num_experts:
        return total
    per_expert = 3 * cfg.model.d_model * (moe.expert_mlp_dim or cfg.model.mlp_dim)
    layers = (cfg.model.num_layers - moe.first_dense_layers) // moe.every_n_layers
    return total - layers * (moe.num_experts - moe.top_k) * per_expert


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f} GB"


def _usd(x) -> str:
    return "n/a" if x is None else f"${x:,.0f}"


def format_plan(plan: dict) -> str:
    m, t = plan["memory"], plan["time"]
    mesh = " ".join(f"{k}={v}" for k, v in plan["mesh"].items() if v > 1) or "1 device"
    active = "" if plan["active_params"] == plan["params"] else \
        f" ({plan['active_params'] / 1e9:.2f}B active per token)"
    lines = [f"{plan['config']} on {plan['devices']} × {plan['hardware']} ({mesh}), "
             f"{plan['params'] / 1e9:.2f}B params{active}",
             "memory per device (estimate):"]
    parts = m["parts"]
    peak = max(memory.PHASES, key=lambda name: parts.get(name, 0))
    for name, value in parts.items():
        aside = "  (not at the peak)" if name in memory.PHASES and name != peak else ""
        lines.append(f"  {name:<14} {_gb(value):>12}{aside}")
    verdict = "fits" if m["fits"] else "DOES NOT FIT"
    lines += [f"  {'total':<14} {_gb(m['total_bytes_per_device']):>12}  of "
              f"{_gb(m['device_bytes'])} ({_gb(m['usable_bytes'])} usable): {verdict}",
              f"  uncertainty: {m['uncertainty']}"]
    if m.get("known_gap"):
        lines.append(f"  estimate known {m['known_gap']}")
    if "compiled" in plan:
        c = plan["compiled"]
        lines.append(f"  XLA compiled   {_gb(c['total_bytes_per_device']):>12}  "
                     f"on {c['devices']} fake {c['platform']} devices, against the "
                     f"CPU-backend estimate {_gb(c['estimate_cpu_bytes'])} (ratio "
                     f"{c['estimate_cpu_bytes'] / c['total_bytes_per_device']:.2f}): "
                     f"{'fits' if c['fits'] else 'DOES NOT FIT'}")
    comm = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t["comm_s"].items() if v)
    lines += ["time per step (predicted):",
              f"  step {t['step_s']:.3f} s = compute {t['compute_s']:.3f} s "
              f"({t['bound']}-bound; memory roofline {t['memory_bound_s']:.3f} s)"
              f"{', comm: ' + comm if comm else ''}, bubble {t['bubble']:.1%}",
              f"  MFU {t['mfu']:.1%}, {t['tokens_per_s']:,.0f} tokens/s, "
              f"{t['tokens_per_step']:,} tokens/step",
              f"  assumes: {t['overlap']}",
              f"  uncertainty: {t['calibration']}"]
    if "checkpoint" in plan:
        lines += checkpoint_io.describe(plan["checkpoint"], _gb)
    if "decode" in plan:
        lines += decode.describe(plan["decode"], _gb)
    if "cost" in plan:
        c = plan["cost"]
        lines += [f"training {t['train_tokens']:.3g} tokens: {t['train_steps']:,.0f} steps, "
                  f"{c['hours']:,.1f} h = {c['days']:,.1f} days",
                  f"  cloud {_usd(c['cloud_usd'])} at {_usd(c['cloud_usd_per_hour'])}/h; "
                  f"energy {c['energy_kwh']:,.0f} kWh; on-premise {_usd(c['on_prem_usd'])} "
                  f"(purchase over {c['amortize_years']:g} years + power at "
                  f"${c['power_usd_per_kwh']}/kWh)"]
    return "\n".join(lines)
