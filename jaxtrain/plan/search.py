"""--search: meshes × remat policies × micro-batch counts for a hardware and device count,
the ones whose estimate fits, ranked by predicted step time or cost."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import ml_collections

from jaxtrain.config import ConfigError, apply_overrides
from jaxtrain.errors import divisor_list
from jaxtrain.hardware import HardwareError
from jaxtrain.plan import memory
from jaxtrain.plan.planner import make_plan

# The policies the memory and time models count directly; the finer named ones are left to
# --config.model.remat by hand.
SEARCH_REMATS = ("none", "full", "save_dots")
# Context parallelism is tried from this sequence length up (below it the row's
# activations rarely need splitting, and the K/V exchange costs more than it saves).
CONTEXT_FROM_SEQ_LEN = 8192


def _context_sizes(cfg, devices: int) -> list[int]:
    if cfg.model.seq_len < CONTEXT_FROM_SEQ_LEN:
        return [1]
    return [c for c in (1, 2, 4, 8) if c <= devices]


def candidates(cfg, devices: int, devices_per_node: int):
    """(overrides, config) for every layout worth trying. Tensor parallelism stays inside a
    node; pipelines use GPipe with enough micro-batches for a bubble near 10%; an MoE model
    also tries its experts over an `expert` axis (a divisor of model.moe.num_experts); long
    sequences also try a `context` axis (not with a pipeline)."""
    experts = cfg.model.moe.num_experts
    expert_sizes = [e for e in divisor_list(experts) if e <= devices] if experts else [1]
    for tensor, pipeline, expert, context in itertools.product(
            divisor_list(devices), (1, 2, 4, 8), expert_sizes, _context_sizes(cfg, devices)):
        split = tensor * pipeline * expert * context
        if tensor > min(devices_per_node, 8) or devices % split or (context > 1 and
                                                                     pipeline > 1):
            continue
        rest = devices // split
        for fsdp in divisor_list(rest):
            batch = cfg.train.global_batch
            for remat, micro in itertools.product(SEARCH_REMATS, divisor_list(batch)):
                if micro > 64:
                    continue
                overrides = {"mesh.data": rest // fsdp, "mesh.fsdp": fsdp,
                             "mesh.tensor": tensor, "mesh.pipeline": pipeline,
                             "mesh.expert": expert, "mesh.context": context,
                             "mesh.sequence_parallel": tensor > 1,
                             "model.remat": remat, "train.microbatches": micro}
                for axis in ("data", "fsdp", "tensor", "pipeline", "expert", "context"):
                    overrides[f"mesh.dcn_{axis}"] = 1
                if pipeline > 1:
                    overrides.update({"pipeline.schedule": "gpipe", "pipeline.repeats": 1,
                                      "pipeline.microbatches": 9 * (pipeline - 1) + 1})
                yield overrides, with_overrides(cfg, overrides)


def with_overrides(cfg, overrides: dict):
    """A copy of cfg (which may be locked) with dotted overrides applied."""
    return apply_overrides(ml_collections.ConfigDict(cfg.to_dict()), overrides)


# The memory model's error bound against the compiler (tests/unit/test_plan.py): a candidate is
# kept only if its estimate fits with this much to spare.
ESTIMATE_ERROR = 1 / memory.TARGET[0]


def search(cfg, hw, devices: int, by: str = "time", top: int = 5,
           confirm: Callable[[dict], dict] | None = None, **plan_args) -> list[dict]:
    """The best `top` plans that fit, each with its 'overrides'. confirm(overrides) -> the
    compiler's memory (compile_check): then candidates are compiled in ranked order and only
    those XLA confirms are returned, each with its 'compiled' figures."""
    fits = []
    for overrides, candidate in candidates(cfg, devices, hw.devices_per_node):
        try:
            plan = make_plan(candidate, hw, devices, **plan_args)
        except (ConfigError, HardwareError):
            continue  # not a valid layout for this model (divisibility, batch split)
        mem = plan["memory"]
        if mem["total_bytes_per_device"] * ESTIMATE_ERROR <= mem["usable_bytes"]:
            plan["overrides"] = {k: v for k, v in overrides.items()
                                 if not (k.startswith("mesh.dcn_") and cfg.mesh[k[5:]] == v)}
            fits.append(plan)
    key = (lambda p: p["cost"]["cloud_usd"] or 0.0) if by == "cost" and fits and \
        "cost" in fits[0] else (lambda p: p["time"]["step_s"])
    fits.sort(key=lambda p: (key(p), p["memory"]["total_bytes_per_device"]))
    if confirm is None:
        return fits[:top]
    confirmed = []
    for plan in fits:
        compiled = confirm(plan["overrides"])
        compiled["fits"] = compiled["total_bytes_per_device"] <= plan["memory"]["usable_bytes"]
        plan["compiled"] = compiled
        if compiled["fits"]:
            confirmed.append(plan)
            if len(confirmed) == top:
                break
    return confirmed


def override_flags(overrides: dict) -> str:
    return " ".join(f"--config.{k}={v}" for k, v in overrides.items())
