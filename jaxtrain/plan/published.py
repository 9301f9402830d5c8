"""Published training runs (plan/published_runs.json) as planner inputs and answers.

Each run is turned into a jaxtrain config with its model shape and layout, and its published
figure into tokens/s per device using the source's own FLOP counting. The comparison is in
tokens/s (equivalently jaxtrain's MFU): sources count FLOPs differently (causal attention
halved or not, recomputation included or not, the embedding table counted or not), so their
MFU figures are not comparable with ours or with each other.
"""

from __future__ import annotations

import functools
import json
import pathlib

from jaxtrain import hardware
from jaxtrain.config import apply_overrides, base_config, dcn_shape, validate
from jaxtrain.models import ModelSpec
from jaxtrain.models.flops import matmul_params
from jaxtrain.plan import memory, timing
from jaxtrain.precision import PRECISIONS

RUNS_FILE = pathlib.Path(__file__).with_name("published_runs.json")


@functools.cache
def runs() -> tuple[dict, ...]:
    return tuple(json.loads(RUNS_FILE.read_text())["runs"])


def config(run: dict):
    """The jaxtrain config of a published run (synthetic data, its shape and layout)."""
    c = base_config()
    c.name = run["id"]
    c.data.source = "synthetic"
    c.mesh.data = 1
    return apply_overrides(c, run["config"])


def source_flops_per_token(spec: ModelSpec, counting: dict) -> float:
    """FLOPs per token as the source counts them."""
    layers = 6.0 * (matmul_params(spec) - spec.d_model * spec.vocab_size)
    head = 6.0 * spec.d_model * spec.vocab_size
    if counting["weights"] == "all_params":
        head += 6.0 * spec.d_model * spec.vocab_size  # the input embedding table too
    attention = 12.0 * spec.num_layers * spec.seq_len * spec.num_heads * spec.head_dim
    if counting["attention"] == "causal":
        attention /= 2
    if counting["recompute"] == "full":  # one more forward of the layers (not the head)
        layers, attention = layers * 4 / 3, attention * 4 / 3
    return layers + head + attention


def published_tokens_per_s(run: dict) -> float:
    """Tokens/s per device, from the published figure and the source's FLOP counting."""
    return _published_tokens_per_s(run["id"])


@functools.cache
def _published_tokens_per_s(run_id: str) -> float:
    run = _run(run_id)
    pub = run["published"]
    if "tokens_per_s_per_device" in pub:
        return pub["tokens_per_s_per_device"]
    spec = ModelSpec.from_config(config(run))
    if "tflops_per_device" in pub:
        flops = pub["tflops_per_device"] * 1e12
    else:
        # Published MFU figures are against the bf16 datasheet peak.
        flops = pub["mfu"] * hardware.get(run["hardware"]).peak_flops(PRECISIONS["bfloat16"])
    return flops / source_flops_per_token(spec, run["flops_counting"])


@functools.cache
def features(run_id: str) -> dict:
    """timing.step_features of a run (counted once: the fit evaluates many calibrations)."""
    run = _run(run_id)
    cfg = config(run)
    hw = hardware.get(run["hardware"])
    sizes = validate(cfg, run["devices"])
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes["pipeline"],
                                 context=sizes["context"])
    shards = memory.param_shards(spec, sizes)
    return timing.step_features(cfg, sizes, hw, shards["total"], dcn_shape(cfg.mesh))


def _run(run_id: str) -> dict:
    return next(r for r in runs() if r["id"] == run_id)


@functools.cache
def _hardware(name: str) -> hardware.Hardware:
    return hardware.get(name)


def predicted_tokens_per_s(run: dict, cal) -> float:
    """The planner's tokens/s per device for a run under calibration `cal`."""
    f = features(run["id"])
    hw = _hardware(run["hardware"])
    t = timing.step_time(f, hw, timing.peaks(hw, PRECISIONS[run["config"]["train.precision"]]),
                         cal)
    return f["tokens_per_step"] / t["step_s"] / f["devices"]


def errors(cal_for_run) -> dict[str, float]:
    """predicted/published − 1 of tokens/s (= of jaxtrain's MFU) for every run; cal_for_run
    maps a run to the calibration to use."""
    return {r["id"]: predicted_tokens_per_s(r, cal_for_run(r)) / published_tokens_per_s(r) - 1
            for r in runs()}
