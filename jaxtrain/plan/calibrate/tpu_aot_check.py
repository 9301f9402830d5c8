"""Ahead-of-time compile checks for TPU, with libtpu and no TPU.

libtpu describes a TPU topology (`jax.experimental.topologies.get_topology_desc`) whose
compile-only devices jit can compile for; nothing is allocated or run. Checked here:

* optimizer.offload_to_host: the jitted train step of a config, compiled with and without
  offload; the Adam moments' compiled input and output shardings must be in `pinned_host`
  memory, and XLA's memory analysis must move their bytes from the device to the host.
* the splash attention kernel (jaxtrain/models/attention/splash.py), forward and gradient: causal
  grouped-query, sliding-window and multi-query, on one chip and sharded over the topology,
  and inside the llama_1b train step.
* mixture of experts (jaxtrain/models/moe.py): configs/tiny_moe.py with the experts over the
  topology's devices (`expert` axis), both dispatch paths (dropless: ragged_dot and
  ragged_all_to_all, which XLA:CPU lacks; capacity: all-to-all); and configs/mixtral_8x7b.py
  on its 64-chip target, whose compiled step must fit the chips' HBM:
      python -m jaxtrain.plan.calibrate.tpu_aot_check --topology v5p:4x4x4 \
          --cases mixtral_8x7b

* the planner's memory estimate against the compiled step of a published TPU run's layout
  (plan/published_runs.json, scaled as memory_check does): --plan RUN_IDS.

    pip install --target /tmp/libtpu_site 'libtpu==0.0.42.*'   # jax[tpu]==0.10.2's pin
    python -m jaxtrain.plan.calibrate.tpu_aot_check [--topology v5e:2x2] [--json]
        [--cases tiny,splash]
    python -m jaxtrain.plan.calibrate.tpu_aot_check --topology v5p:4x4x4 \
        --plan maxtext-v5p-32b

libtpu is kept out of the main environment (jax would otherwise look for a TPU in every
process): this module re-runs itself with PYTHONPATH=--libtpu_site when `import libtpu`
fails. The process's own backend stays CPU (JAX_PLATFORMS=cpu). Hence the function-level
imports: jax and jaxtrain load only in that re-run process, with its environment set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from importlib import metadata

from jaxtrain.plan.calibrate import ROOT  # imports nothing: jax is not loaded here

MODULE = "jaxtrain.plan.calibrate.tpu_aot_check"
CASES = ("tiny", "llama_1b", "splash", "llama_1b_splash", "moe_tiny")
# Not run by default: llama_1b on one 16 GiB v5e chip, which neither variant fits; the
# Mixtral-shaped pod config (64 chips: --topology v5p:4x4x4); the long-context layouts
# (8 chips: --topology v5p:2x2x2).
# configs/llama_1b_32k.py (llama_1b, full remat, Llama-3 RoPE scaling) on 8 chips
# (--topology v5p:2x2x2): one 32k row per chip without context parallelism (fsdp=8, the
# TPU's splash kernel), one row split over the 8 chips (context=8), and a 131k row so.
CONTEXT_CASES = {
    "llama_1b_32k_cp1": {"mesh.context": 1, "mesh.fsdp": 8, "train.global_batch": 8,
                         "model.attention": "auto"},
    "llama_1b_32k_cp8": {"mesh.context": 8, "mesh.fsdp": 1, "train.global_batch": 1},
    "llama_1b_32k_cp8_ring": {"mesh.context": 8, "mesh.fsdp": 1, "train.global_batch": 1,
                              "model.context_attention": "ring"},
    "llama_1b_131k_cp8": {"mesh.context": 8, "mesh.fsdp": 1, "train.global_batch": 1,
                          "model.seq_len": 131072, "model.rope_scaling.factor": 64.0},
}
EXTRA_CASES = ("llama_1b_1chip", "mixtral_8x7b", *CONTEXT_CASES)
# HBM per chip, bytes (jaxtrain/plan/hardware.json), for the fits-or-not verdict.
HBM = {"TPU v5": 95e9, "TPU v5 lite": 16e9, "TPU v6 lite": 32e9, "TPU v4": 32e9}


def _accelerator_type(topology: str) -> str | None:
    """TPU_ACCELERATOR_TYPE for a topology name such as v5e:2x2 (libtpu warns without it)."""
    kind, _, dims = topology.partition(":")
    chips = math.prod(int(d) for d in dims.split("x")) if dims else 0
    return {"v5e": f"v5litepod-{chips}", "v6e": f"v6e-{chips}", "v4": f"v4-{2 * chips}",
            "v5p": f"v5p-{2 * chips}"}.get(kind)


def tpu_env(libtpu_site: str | None, topology: str) -> dict:
    """The environment for a compile-only libtpu process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               TPU_WORKER_ID="0", TPU_WORKER_HOSTNAMES="localhost",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    accelerator = _accelerator_type(topology)
    if accelerator:
        env.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
    paths = [ROOT] + ([libtpu_site] if libtpu_site else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


# ---------------------------------------------------------------- train step, offload

def _moment_leaves(tree):
    """(path, leaf) of the Adam moments (mu, nu) in an opt_state-shaped tree."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), x) for p, x in flat
            if any(getattr(k, "name", None) in ("mu", "nu") for k in p)]


def _shard_bytes(sds) -> int:
    shape = sds.sharding.shard_shape(sds.shape)
    return math.prod(shape) * sds.dtype.itemsize


def train_case(name: str, config_file: str, overrides: dict, devices, offload: bool) -> dict:
    """Compiles the train step of a config for the topology; returns its memory figures."""
    import jax

    from jaxtrain.config import apply_overrides, load_config_file
    from jaxtrain.train.setup import build

    cfg = apply_overrides(load_config_file(os.path.join(ROOT, config_file)),
                          {**overrides, "optimizer.offload_to_host": offload})
    setup = build(cfg, devices)
    tokens = setup.abstract_batch()
    # Outside set_mesh: under a mesh of compile-only devices, the eager jax.random.key
    # inside abstract_state would be dispatched to them and fail.
    state = setup.abstract_step_state()
    start = time.perf_counter()
    with jax.set_mesh(setup.mesh):
        try:
            compiled = setup.train_step().lower(state, tokens).compile()
        except jax.errors.JaxRuntimeError as e:  # e.g. RESOURCE_EXHAUSTED: HBM too small
            error = str(e).splitlines()[0]
            compiled = None
    seconds = time.perf_counter() - start
    row = {"case": name, "config": config_file, "overrides": overrides, "offload": offload,
           "attention": setup.spec.attention,
           "devices": len(devices), "device_kind": devices[0].device_kind,
           "mesh": dict(zip(setup.mesh.axis_names, setup.mesh.devices.shape)),
           "moment_bytes_per_device": sum(_shard_bytes(x)
                                          for _, x in _moment_leaves(state.opt_state)),
           "param_bytes_per_device": sum(_shard_bytes(x) for x in jax.tree.leaves(state.params)),
           "compile_s": round(seconds, 1)}
    if compiled is None:
        return {**row, "error": error}
    m = compiled.memory_analysis()
    (in_state, _), _ = compiled.input_shardings
    out_state, _ = compiled.output_shardings
    moments_in = {s.memory_kind for _, s in _moment_leaves(in_state.opt_state)}
    moments_out = {s.memory_kind for _, s in _moment_leaves(out_state.opt_state)}
    params_in = {s.memory_kind for s in jax.tree.leaves(in_state.params)}
    hlo = compiled.as_text()
    return {
        **row,
        "moments_memory_in": sorted(moments_in), "moments_memory_out": sorted(moments_out),
        "params_memory_in": sorted(params_in),
        "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
        "host_argument_bytes": m.host_argument_size_in_bytes,
        "host_output_bytes": m.host_output_size_in_bytes,
        "host_alias_bytes": m.host_alias_size_in_bytes,
        "host_temp_bytes": m.host_temp_size_in_bytes,
        "peak_bytes": getattr(m, "peak_memory_in_bytes", None),
        "tpu_custom_calls": hlo.count('custom_call_target="tpu_custom_call"'),
        "ragged_all_to_all": hlo.count("ragged-all-to-all"),
        "all_to_all": hlo.count(" all-to-all("),
    }


def check_offload(off: dict, on: dict) -> tuple[list[str], list[str]]:
    """(problems, notes) between a step compiled without and with offload_to_host. A problem:
    the moments are not in host memory between steps. A note: the device peak did not fall."""
    if "error" in on or "error" in off:
        return [], [f"{r['case']} offload={r['offload']}: {r['error']}"
                    for r in (off, on) if "error" in r]
    problems, notes = [], []
    if on["moments_memory_in"] != ["pinned_host"] or on["moments_memory_out"] != ["pinned_host"]:
        problems.append(f"{on['case']}: offloaded moments compiled in {on['moments_memory_in']}"
                        f" / {on['moments_memory_out']} memory, not pinned_host")
    if off["moments_memory_in"] != ["device"]:
        problems.append(f"{off['case']}: moments without offload in {off['moments_memory_in']}")
    if on["params_memory_in"] != ["device"]:
        problems.append(f"{on['case']}: params in {on['params_memory_in']} memory")
    moments = on["moment_bytes_per_device"]
    moved = off["argument_bytes"] - on["argument_bytes"]
    if on["host_argument_bytes"] < moments or moved < 0.99 * moments:
        problems.append(f"{on['case']}: host argument bytes {on['host_argument_bytes']} / "
                        f"device argument bytes saved {moved}, expected ~{moments} of moments")
    if off["peak_bytes"] and on["peak_bytes"] and on["peak_bytes"] >= off["peak_bytes"]:
        notes.append(f"{on['case']}: device peak {mib(off['peak_bytes'])} MiB without offload, "
                     f"{mib(on['peak_bytes'])} MiB with (moments: {mib(moments)} MiB)")
    return problems, notes


# ---------------------------------------------------------------- splash kernel alone

SPLASH_CASES = [
    # name, batch, length, heads, kv heads, head_dim, window, sharded over the topology
    ("causal GQA 32/8", 2, 2048, 32, 8, 128, None, False),
    ("window 512 GQA 32/8", 2, 4096, 32, 8, 128, 512, False),
    ("causal MQA 16/1", 2, 2048, 16, 1, 128, None, False),
    ("causal GQA 32/8, batch over fsdp", 8, 2048, 32, 8, 128, None, True),
]


def splash_case(name, b, length, heads, groups, head_dim, window, sharded, devices) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain.config import MESH_AXES
    from jaxtrain.models.attention.splash import splash_attention

    dt = jnp.bfloat16
    if sharded:
        shape = {"fsdp": len(devices)}
        mesh = Mesh(np.asarray(devices).reshape([shape.get(a, 1) for a in MESH_AXES]),
                    MESH_AXES)
        sharding = NamedSharding(mesh, P(("data", "fsdp")))
    else:
        mesh, sharding = None, SingleDeviceSharding(devices[0])
    q = jax.ShapeDtypeStruct((b, length, heads, head_dim), dt, sharding=sharding)
    kv = jax.ShapeDtypeStruct((b, length, groups, head_dim), dt, sharding=sharding)

    def attend(q, k, v):
        # The default interpret=None: lowered for TPU, the kernel is compiled.
        return splash_attention(q, k, v, window)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    row = {"case": name, "batch": b, "length": length, "heads": heads, "kv_heads": groups,
           "head_dim": head_dim, "window": window, "devices": len(devices) if sharded else 1}
    for part, fn in (("fwd", attend), ("grad", jax.grad(loss, argnums=(0, 1, 2)))):
        start = time.perf_counter()
        if mesh is None:
            compiled = jax.jit(fn).lower(q, kv, kv).compile()
        else:
            with jax.set_mesh(mesh):
                compiled = jax.jit(fn).lower(q, kv, kv).compile()
        m = compiled.memory_analysis()
        hlo = compiled.as_text()
        row[part] = {"compile_s": round(time.perf_counter() - start, 1),
                     "tpu_custom_calls": hlo.count('custom_call_target="tpu_custom_call"'),
                     "all_gathers": hlo.count(" all-gather("),
                     "argument_bytes": m.argument_size_in_bytes,
                     "output_bytes": m.output_size_in_bytes,
                     "temp_bytes": m.temp_size_in_bytes,
                     "peak_bytes": getattr(m, "peak_memory_in_bytes", None)}
    return row


# ---------------------------------------------------------------- planner vs TPU compile

def plan_case(run_id: str, devices) -> dict:
    """A published TPU run's layout (memory_check.scaled_run: ≤ the topology's chips,
    ≤ 2 layers a stage), compiled for the TPU topology, against the planner's TPU estimate
    (bf16 activations, the TPU factors: real device memory)."""
    from jaxtrain.plan import memory_fit, published
    from jaxtrain.plan.calibrate.memory_check import scaled_run
    from jaxtrain.plan.compile_check import compile_step, memory_figures
    from jaxtrain.train.setup import build

    run = next(r for r in published.runs() if r["id"] == run_id)
    case = {**scaled_run(run, max_devices=len(devices), cpu=False), "source": "tpu"}
    if case["devices"] > len(devices):
        return {"case": run_id, "devices": case["devices"],
                "error": f"its layout needs {case['devices']} chips; the topology has "
                         f"{len(devices)}"}
    cfg, _ = memory_fit.config_of(case)
    on = devices[:case["devices"]]
    estimate = memory_fit.estimate(case)
    start = time.perf_counter()
    try:
        figures = memory_figures(compile_step(build(cfg, on)))
    except jax_runtime_error() as e:
        return {"case": run_id, "devices": len(on), "error": str(e).splitlines()[0][:200]}
    return {**{k: case[k] for k in ("case", "config_file", "overrides", "devices", "source")},
            "attention": cfg.model.attention, "layers": cfg.model.num_layers,
            "estimate_bytes": estimate, "compiled_bytes": figures["total_bytes_per_device"],
            "ratio": estimate / figures["total_bytes_per_device"],
            "temp_bytes": figures["temp_bytes"], "argument_bytes": figures["argument_bytes"],
            "compile_s": round(time.perf_counter() - start, 1)}


def jax_runtime_error():
    import jax

    return jax.errors.JaxRuntimeError


# ---------------------------------------------------------------- mixture of experts

MOE_CASES = {
    "moe_tiny": [("configs/tiny_moe.py", {"mesh.expert": -1, "mesh.data": 1,
                                          "model.moe.dispatch": dispatch})
                 for dispatch in ("dropless", "capacity")],
    "mixtral_8x7b": [("configs/mixtral_8x7b.py", {})],
}


def moe_case(name: str, config_file: str, overrides: dict, devices) -> dict:
    """The MoE train step compiled for the topology: memory, and the collectives that carry
    the tokens to their experts."""
    from jaxtrain.models.moe import resolve_dispatch

    row = fitted_case(name, config_file, overrides, devices)
    return {**row, "dispatch": resolve_dispatch(overrides.get("model.moe.dispatch", "auto"),
                                                "tpu")}


def fitted_case(name: str, config_file: str, overrides: dict, devices) -> dict:
    """train_case (no offload) with the chip's HBM and whether the step's peak fits it."""
    row = train_case(name, config_file, overrides, devices, offload=False)
    if "error" in row:
        return row
    hbm = next((v for k, v in sorted(HBM.items(), key=lambda kv: -len(kv[0]))
                if devices[0].device_kind.startswith(k)), None)
    peak = row["peak_bytes"] or row["argument_bytes"] + row["temp_bytes"]
    return {**row, "hbm_bytes": hbm, "fits": hbm is not None and peak <= hbm}


# ---------------------------------------------------------------- long context

def context_case(name: str, devices) -> dict:
    """A long-context layout of configs/llama_1b_32k.py compiled for the topology: its
    per-chip memory against the chip's HBM."""
    return fitted_case(name, "configs/llama_1b_32k.py", CONTEXT_CASES[name], devices)


# ---------------------------------------------------------------- driver

# 'auto' picks splash on TPU; the plain llama_1b case keeps the chunked kernel to compare.
TRAIN_CASES = {"tiny": ("configs/tiny.py", {"model.attention": "chunked"}),
               "llama_1b": ("configs/llama_1b.py", {"mesh.fsdp": -1,
                                                    "model.attention": "chunked"}),
               "llama_1b_splash": ("configs/llama_1b.py", {"mesh.fsdp": -1,
                                                           "model.attention": "splash"}),
               "llama_1b_1chip": ("configs/llama_1b.py", {"mesh.fsdp": 1, "mesh.data": 1,
                                                          "train.global_batch": 2})}


def run(args) -> dict:
    import jax
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
    devices = list(topo.devices)
    import libtpu

    result = {"topology": args.topology, "devices": len(devices),
              "device_kind": devices[0].device_kind, "platform": devices[0].platform,
              "memories": sorted(m.kind for m in devices[0].addressable_memories()),
              "jax": jax.__version__, "libtpu": _libtpu_version(libtpu),
              "train": [], "splash": [], "moe": [], "context": [], "problems": [],
              "notes": []}
    if args.plan:
        return _plan(args, devices, result)
    cases = args.cases.split(",")
    train = TRAIN_CASES
    unknown = set(cases) - set(train) - {"splash"} - set(MOE_CASES) - set(CONTEXT_CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {CASES + EXTRA_CASES}")
    for name in [c for c in cases if c in train]:
        file, overrides = train[name]
        on = devices[:1] if name.endswith("_1chip") else devices
        fn = name.endswith("_splash")
        rows = [train_case(name, file, overrides, on, offload)
                for offload in (False, True)]
        result["train"] += rows
        problems, notes = check_offload(*rows)
        result["problems"] += problems
        result["notes"] += notes
        if fn and not all(r.get("tpu_custom_calls", 1) for r in rows):
            result["problems"].append(f"{name}: no Mosaic kernel in the compiled step")
    for name in [c for c in cases if c in MOE_CASES]:
        for file, overrides in MOE_CASES[name]:
            row = moe_case(name, file, overrides, devices)
            result["moe"].append(row)
            if "error" in row or not row["fits"]:
                result["problems"].append(f"{name} {overrides}: does not compile or fit: "
                                          f"{row.get('error', row.get('peak_bytes'))}")
            elif row["dispatch"] == "dropless" and not row["ragged_all_to_all"]:
                result["problems"].append(f"{name}: no ragged all-to-all in the dropless step")
            elif row["dispatch"] == "capacity" and not row["all_to_all"]:
                result["problems"].append(f"{name}: no all-to-all in the capacity step")
    for name in [c for c in cases if c in CONTEXT_CASES]:
        row = context_case(name, devices)
        result["context"].append(row)
        if "error" in row or not row["fits"]:
            result["problems"].append(f"{name}: does not compile or fit: "
                                      f"{row.get('error', row.get('peak_bytes'))}")
    if "splash" in cases:
        for spec in SPLASH_CASES:
            row = splash_case(*spec, devices)
            result["splash"].append(row)
            for part in ("fwd", "grad"):
                if not row[part]["tpu_custom_calls"]:
                    result["problems"].append(f"splash {row['case']} {part}: no Mosaic kernel")
                if row["devices"] > 1 and row[part]["all_gathers"]:
                    result["problems"].append(f"splash {row['case']} {part}: all-gathers")
    return result


def _plan(args, devices, result: dict) -> dict:
    """--plan: the published TPU runs' layouts against the planner's estimate."""
    from jaxtrain.plan import memory_fit, published

    generation = args.topology.partition(":")[0]  # v5p:2x2x2 -> runs on TPU-v5p
    ids = [r["id"] for r in published.runs() if r["hardware"] == f"TPU-{generation}"] \
        if args.plan == "tpu" else args.plan.split(",")
    result["plan"] = []
    for run_id in ids:
        result["plan"].append(plan_case(run_id, devices))
        print(json.dumps(result["plan"][-1]), file=sys.stderr, flush=True)
    if args.update:
        memory_fit.store_cases([r for r in result["plan"] if "error" not in r])
    result["problems"] += [
        f"{r['case']}: " + (r.get("error") or f"estimate/XLA {r['ratio']:.2f}")
        for r in result["plan"] if "error" in r
        or not memory_fit.within(r["ratio"])]
    return result


def _libtpu_version(libtpu) -> str:
    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return getattr(libtpu, "__version__", "unknown")


def mib(n) -> str:
    return f"{n / 2**20:,.1f}"


def _fitted_table(title: str, rows: list[dict], extra: dict) -> None:
    """fitted_case rows: case, mesh, the `extra` columns (name -> row -> cell), memory."""
    if not rows:
        return
    heads = ["case", "mesh", *extra, "device args", "device temp", "device peak", "HBM",
             "fits", "compile s"]
    print(f"\n{title}:\n| " + " | ".join(heads) + " |\n|" + "---|" * len(heads))
    for r in rows:
        mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
        if "error" in r:
            print(f"| {r['case']} | {mesh} | compile failed: {r['error'][:100]} |")
            continue
        cells = [r["case"], mesh, *(str(cell(r)) for cell in extra.values()),
                 mib(r["argument_bytes"]), mib(r["temp_bytes"]), mib(r["peak_bytes"] or 0),
                 mib(r["hbm_bytes"] or 0), str(r["fits"]), str(r["compile_s"])]
        print("| " + " | ".join(cells) + " |")


def print_table(result: dict) -> None:
    print(f"topology {result['topology']}: {result['devices']} × {result['device_kind']} "
          f"(memories: {', '.join(result['memories'])}); jax {result['jax']}, "
          f"libtpu {result['libtpu']}")
    if result["train"]:
        print("\ntrain step, per device (MiB):")
        print("| case | attention | offload | moments in/out | moments | device args | "
              "host args | device temp | host temp | device peak | compile s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in result["train"]:
            head = f"| {r['case']} ({r['devices']} dev) | {r['attention']} | {r['offload']} | "
            if "error" in r:
                print(head + f"compile failed: {r['error'][:100]} ||||||||")
                continue
            print(head + f"{'/'.join(r['moments_memory_in'])} → "
                  f"{'/'.join(r['moments_memory_out'])} | "
                  f"{mib(r['moment_bytes_per_device'])} | {mib(r['argument_bytes'])} | "
                  f"{mib(r['host_argument_bytes'])} | {mib(r['temp_bytes'])} | "
                  f"{mib(r['host_temp_bytes'])} | {mib(r['peak_bytes'] or 0)} | "
                  f"{r['compile_s']} |")
    for r in result.get("plan", []):
        print(f"plan {r['case']} ({r['devices']} chips): " + (r.get("error") or (
            f"estimate {mib(r['estimate_bytes'])} MiB, XLA {mib(r['compiled_bytes'])} MiB, "
            f"ratio {r['ratio']:.2f}, compile {r['compile_s']} s")))
    if result["splash"]:
        print("\nsplash attention (bf16), per device:")
        print("| case | B×L, heads/kv, head_dim | devices | fwd: kernels, temp MiB, peak MiB, s | "
              "grad: kernels, temp MiB, peak MiB, s |")
        print("|---|---|---|---|---|")
        for r in result["splash"]:
            f, g = r["fwd"], r["grad"]
            print(f"| {r['case']} | {r['batch']}×{r['length']}, {r['heads']}/{r['kv_heads']}, "
                  f"{r['head_dim']} | {r['devices']} | {f['tpu_custom_calls']}, "
                  f"{mib(f['temp_bytes'])}, {mib(f['peak_bytes'] or 0)}, {f['compile_s']} | "
                  f"{g['tpu_custom_calls']}, {mib(g['temp_bytes'])}, "
                  f"{mib(g['peak_bytes'] or 0)}, {g['compile_s']} |")
    _fitted_table("mixture of experts, train step per device (MiB)", result["moe"], {
        "dispatch": lambda r: r["dispatch"],
        "ragged a2a / a2a": lambda r: f"{r['ragged_all_to_all']} / {r['all_to_all']}"})
    _fitted_table("long context (llama_1b_32k.py), train step per chip (MiB)",
                  result["context"], {
                      "seq": lambda r: r["overrides"].get("model.seq_len", 32768),
                      "attention": lambda r: r["attention"]})
    for note in result["notes"]:
        print("note: " + note)
    print("\nproblems: " + ("; ".join(result["problems"]) or "none"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES + EXTRA_CASES)}")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--plan", help="published run ids (plan/published_runs.json) whose "
                        "scaled layouts to compile and compare with the planner's estimate; "
                        "'tpu': every run on the topology's TPU generation")
    parser.add_argument("--update", action="store_true", help="with --plan: store the "
                        "compiled figures in plan/memory_fit.json (calibrate/fit_memory.py)")
    parser.add_argument("--libtpu_site", default=os.environ.get("LIBTPU_SITE",
                                                                "/tmp/libtpu_site"))
    parser.add_argument("--in_process", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if not args.in_process:
        # A fresh process with the TPU environment set before jax is imported.
        site = None if importlib.util.find_spec("libtpu") else args.libtpu_site
        if site and not os.path.isdir(os.path.join(site, "libtpu")):
            sys.exit(f"libtpu is not importable and not in {site}; install it with: pip "
                     f"install --target {site} 'libtpu==0.0.42.*'")
        command = [sys.executable, "-m", MODULE, *argv, "--in_process"]
        sys.exit(subprocess.run(command, env=tpu_env(site, args.topology)).returncode)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    sys.exit(1 if result["problems"] else 0)


if __name__ == "__main__":
    main()
