"""Config defaults and validation.

Every config file in configs/ starts from `base_config()`, or from the config it extends
loaded with `load_config_file()` (configs/_*.py are bases several configs share), and
overrides what it needs, so the set of keys is defined once: each section beside the module
that reads it (its `defaults()`), assembled here. `validate()` catches impossible
combinations before anything compiles and names the key with the values that would be
valid. Each extensible choice (model family, attention kernel, remat policy, precision, data
source, batch layout, objective, mesh axis, schedule) is a registry entry in the module that
implements it, carrying its own checks; validate() asks the registries, so this module sits
above them and they never import it.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

from jaxtrain import distributed as distributed_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import objectives as objectives_lib
from jaxtrain import optim as optim_lib
from jaxtrain import sinks as sinks_lib
from jaxtrain import tasks as tasks_lib
from jaxtrain.data import sources as sources_lib
from jaxtrain.data.layouts import LAYOUTS
from jaxtrain.data.remote_file import check_cache_config
from jaxtrain.data.sources import SOURCES
from jaxtrain.errors import ConfigError, divisors, fail
from jaxtrain.mesh import (
    AXES,
    DEFAULT_RULES,
    MESH_AXES,
    batch_shards,
    dcn_shape,
    resolve_mesh_shape,
    validate_axes,
)
from jaxtrain.models import lora as lora_lib
from jaxtrain.models import mla as mla_lib
from jaxtrain.models import moe as moe_lib
from jaxtrain.models import mtp as mtp_lib
from jaxtrain.models import rope as rope_lib
from jaxtrain.models import router as router_lib
from jaxtrain.models.attention import KERNELS, resolve_attention, resolve_variant
from jaxtrain.models.attention import VARIANTS as CONTEXT_VARIANTS
from jaxtrain.models.families import (
    FAMILIES,
    check_layer_pattern,
    layer_pattern,
    linear_layers,
    pattern_window,
)
from jaxtrain.models.linear_attention import layer as linear_lib
from jaxtrain.models.remat import REMATS
from jaxtrain.objectives import OBJECTIVES
from jaxtrain.optim import OPTIMIZERS, SCHEDULES
from jaxtrain.parallel import pipeline as pipeline_lib
from jaxtrain.parallel.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from jaxtrain.precision import PRECISIONS
from jaxtrain.sinks import validate_sinks
from jaxtrain.storage import check_path
from jaxtrain.tasks import BACKENDS, split_list
from jaxtrain.tasks.text import check_text
from jaxtrain.workdir import check_local_path

__all__ = ["DEFAULT_RULES", "MESH_AXES", "ConfigError", "apply_overrides",
           "base_config", "dcn_shape", "load_config_file", "resolve_mesh_shape", "validate"]


def base_config() -> ml_collections.ConfigDict:
    """Every key a config may set, with its default. A section is written beside the module
    that reads it (that module's `defaults()`); the sections whose readers sit above this
    module (train/, the loop's hooks) and the model's core keys are the functions below."""
    return ml_collections.ConfigDict({
        **_run(), "mesh": mesh_lib.defaults(), "pipeline": pipeline_lib.defaults(),
        "model": _model(), "train": _train(), "profile": _profile(),
        "optimizer": optim_lib.defaults(), "data": sources_lib.defaults(),
        "eval": tasks_lib.defaults(), "metrics": sinks_lib.defaults(),
        "checkpoint": _checkpoint(), "distributed": distributed_lib.defaults(),
        "debug": _debug()})


def _run() -> dict:
    return {"name": "base", "steps": 100, "seed": 0, "log_every_steps": 10,
            "eval_every_steps": 50, "eval_batches": 4}


def _model() -> dict:
    """The `model` section: ModelSpec.from_config (models/transformer.py) reads it."""
    return {
        "family": "gpt2",
        "d_model": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 0,  # 0: same as num_heads
        "head_dim": 0,  # 0: d_model // num_heads
        "mlp_dim": 512,
        "vocab_size": 256,
        "seq_len": 128,
        "attention": "auto",  # cudnn on NVIDIA GPUs in bf16/fp16, else chunked
        "sliding_window": 0,  # 0: full causal attention; W: each token sees its last W
        # Each layer's kind, comma-separated (models/families.py LAYER_KINDS: full, sliding),
        # a shorter list repeating; "": every layer alike, windowed where sliding_window is set.
        "layer_types": "",
        # mesh.context > 1: how K/V reach every device (models/attention/context_variants.py):
        # allgather (one all-gather per layer), ring (ppermute hops), auto (allgather under
        # GQA, else ring).
        "context_attention": "auto",
        "remat": "none",
        "rope_theta": 10000.0,
        # RoPE rotates each head's first partial_rotary_factor·head_dim features (HF's
        # partial_rotary_factor), the rest pass as they are; 1: all.
        "partial_rotary_factor": 1.0,
        # The sliding layers' theta, unscaled (HF's rope_local_base_freq); 0: as full layers
        "rope_local_theta": 0.0,
        # q·k scaled by attention_scale_dim**-0.5 (HF's query_pre_attn_scalar); 0: head_dim
        "attention_scale_dim": 0,
        # c·tanh(score/c) on the attention scores before softmax (HF's
        # attn_logit_softcapping); 0: none. Kernels that cannot are refused (KERNELS softcap).
        "attn_logit_softcap": 0.0,
        "final_logit_softcap": 0.0,  # c·tanh(logit/c) on the output logits; 0: none
        "rope_scaling": rope_lib.defaults(),
        "norm_eps": 1e-5,
        # The output head is the token embedding table: one array, trained as one (HF's
        # tie_word_embeddings). The families whose head is always the table (gpt2, gemma2,
        # gemma3) are tied whatever this says.
        "tie_embeddings": False,
        "init_std": 0.02,
        "moe": {**moe_lib.defaults(), **router_lib.defaults()},
        "mla": mla_lib.defaults(),  # multi-head latent attention (kv_lora_rank 0: GQA)
        "mtp": mtp_lib.defaults(),  # multi-token prediction (depths 0: none)
        "lora": lora_lib.defaults(),
        # The linear_attention layers' shape (Gated DeltaNet, models/linear_attention/)
        "linear_attention": linear_lib.defaults(),
    }


def _train() -> dict:
    """The `train` section: the step (train/step.py), its guards and watchdog."""
    return {
        "global_batch": 8,
        # Gradient accumulation: the global batch is split into this many micro-batches, run
        # one after another and their gradients summed (pipeline.microbatches is another
        # thing).
        "microbatches": 1,
        "precision": "float32",  # precision.py PRECISIONS
        "max_consecutive_bad_steps": 5,  # non-finite steps in a row before the run stops
        # Hang watchdog: no step (or evaluation, or checkpoint save) completing for this long
        # dumps every thread's stack and exits with code 4; 0: off.
        "step_timeout_s": 1800.0,
        "mfu_floor": 0.0,  # warn when a logged step's MFU is below this; 0: never
        # float16 only: dynamic loss scaling, doubled after this many finite steps in a row.
        "loss_scale_init": 2.0**15,
        "loss_scale_period": 2000,
        # train.objective and each objective's section (train.dpo, train.simpo, train.grpo).
        **objectives_lib.defaults(),
    }


def _profile() -> dict:
    """A jax.profiler trace (TensorBoard/Perfetto) of steps [start_step, start_step +
    num_steps) and a device memory profile, in WORKDIR/profile; start_step -1: none
    (train/profiling.py)."""
    return {"start_step": -1, "num_steps": 3}


def _checkpoint() -> dict:
    """The `checkpoint` section (train/checkpointing.py, docs/operations.md)."""
    return {
        "every_steps": 0,  # 0: only at the end of the run
        "keep": 3,  # healthy checkpoints kept (docs/operations.md)
        "keep_period": 0,  # also keep every N-th step forever; 0: none
        # A second, fast tier (a local SSD; for a multi-process job, a directory every process
        # sees): saved every local_every_steps, keeping local_keep. Restore takes the newest
        # intact step of either tier.
        "local_dir": "",
        "local_every_steps": 0,
        "local_keep": 2,
        "verify_on_restore": True,  # check every file's checksum before restoring
    }


def _debug() -> dict:
    """Test-only fault injection (train/faults.py): a NaN loss at steps [nan_from_step,
    nan_from_step + nan_steps); the input of step hang_at_step never comes."""
    return {"nan_from_step": -1, "nan_steps": 1, "hang_at_step": -1}


def load_config_file(path) -> ml_collections.ConfigDict:
    """get_config() of a config file, as --config loads it; ConfigError (one line) when the
    file is missing or broken."""
    path = pathlib.Path(str(path).split(":")[0])
    if not path.is_file():
        raise ConfigError(f"--config={path}: no such file")
    spec = importlib.util.spec_from_file_location(f"_config_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return module.get_config()
    except Exception as e:  # noqa: BLE001 - any failure of a user's file is an input error
        where = ""
        tb = e.__traceback__
        while tb is not None:  # the innermost frame inside the config file
            if tb.tb_frame.f_code.co_filename == str(path):
                where = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        raise ConfigError(f"--config={path} cannot be loaded{where}: "
                          f"{type(e).__name__}: {e}") from None


def apply_overrides(c: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """Sets dotted keys ({"model.d_model": 64}), as --config.KEY=VALUE does."""
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return c


def _choice(c, key: str, choices) -> None:
    value = c
    for part in key.split("."):
        value = value[part]
    if value not in choices:
        fail(key, value, f"valid values are {', '.join(choices)}")


def _check_paths(c) -> None:
    """The data may be on object storage (storage.check_path: gs://, s3://, their client
    installed), read through a cache whose sizes are checked here; every other path of the
    config is local (workdir.check_local_path)."""
    d, e = c.data, c.eval
    for key, values in (("data.path", [d.path]), ("data.val_path", [d.val_path]),
                        ("data.mixture", split_list(d.mixture)),
                        ("model.lora.base", [c.model.lora.base]),
                        ("data.tokenizer", [d.tokenizer]),
                        ("train.dpo.reference", [c.train.dpo.reference]),
                        ("train.grpo.reference", [c.train.grpo.reference])):
        for value in values:
            check_path(value, key)
    check_cache_config(c)
    for key, values in (("checkpoint.local_dir", [c.checkpoint.local_dir]),
                        ("eval.tasks", split_list(e.tasks)),
                        ("eval.task_dir", split_list(e.task_dir))):
        for value in values:
            check_local_path(value, key)


def _check_numbers(c) -> None:
    """Plain ranges of the keys no registry owns."""
    for key in ("steps", "log_every_steps", "eval_every_steps", "eval_batches"):
        if c[key] < 1:
            fail(key, c[key], "must be >= 1")
    m = c.model
    for key in ("d_model", "num_layers", "num_heads", "mlp_dim", "vocab_size", "seq_len"):
        if m[key] < 1:
            fail(f"model.{key}", m[key], "must be >= 1")
    if m.sliding_window < 0:
        fail("model.sliding_window", m.sliding_window, "must be 0 (off) or a window >= 1")
    if not 0.0 < c.data.val_fraction < 1.0:
        fail("data.val_fraction", c.data.val_fraction, "must be between 0 and 1")
    if c.optimizer.lr <= 0:
        fail("optimizer.lr", c.optimizer.lr, "must be > 0")
    if c.optimizer.warmup_steps < 0:
        fail("optimizer.warmup_steps", c.optimizer.warmup_steps, "must be >= 0")
    for key, low in (("every_steps", 0), ("keep", 1), ("keep_period", 0),
                     ("local_every_steps", 0), ("local_keep", 1)):
        if c.checkpoint[key] < low:
            fail(f"checkpoint.{key}", c.checkpoint[key], f"must be >= {low}")
    if c.checkpoint.local_every_steps and not c.checkpoint.local_dir:
        fail("checkpoint.local_every_steps", c.checkpoint.local_every_steps,
             "needs checkpoint.local_dir (a fast local directory for that tier)")
    if c.train.step_timeout_s < 0:
        fail("train.step_timeout_s", c.train.step_timeout_s, "must be >= 0 (0: no watchdog)")
    for key in ("heartbeat_timeout_s", "initialization_timeout_s"):
        if c.distributed[key] < 1:
            fail(f"distributed.{key}", c.distributed[key], "must be >= 1 (seconds)")
    if c.train.loss_scale_init <= 0 or c.train.loss_scale_period < 1:
        fail("train.loss_scale_init", c.train.loss_scale_init, "loss_scale_init must be > 0 "
             "and loss_scale_period >= 1")
    if c.profile.num_steps < 1:
        fail("profile.num_steps", c.profile.num_steps, "must be >= 1")
    if c.train.max_consecutive_bad_steps < 1:
        fail("train.max_consecutive_bad_steps", c.train.max_consecutive_bad_steps, "must be >= 1")


def _check_model(c, platform: str | None) -> None:
    m = c.model
    if m.seq_len < (least := LAYOUTS[c.data.packing].min_seq_len):
        fail("model.seq_len", m.seq_len, f"data.packing={c.data.packing!r} needs >= {least}")
    heads, kv_heads = m.num_heads, m.num_kv_heads or m.num_heads
    if heads % kv_heads:
        fail("model.num_kv_heads", m.num_kv_heads,
             f"must divide model.num_heads={heads}: one of {divisors(heads)}")
    if not m.head_dim and m.d_model % heads:
        fail("model.num_heads", heads, f"must divide model.d_model={m.d_model} "
             "(or set model.head_dim)")
    FAMILIES[m.family].check(m.head_dim or m.d_model // heads)
    check_layer_pattern(m)
    rope_lib.check(m.rope_scaling)
    if m.rope_scaling.type != "none" and not FAMILIES[m.family].rope:
        fail("model.rope_scaling.type", m.rope_scaling.type, f"model.family={m.family!r} has "
             "learned positions, no RoPE: use none")
    documents = objectives_lib.document_masks(c)
    window = pattern_window(m)
    parts = FAMILIES[m.family].kernel_parts
    kernel = resolve_attention(m.attention, c.train.precision, platform or "", m.seq_len,
                               window, documents, m.attn_logit_softcap, parts)
    if problem := KERNELS[kernel].problem(c.train.precision, platform, m.seq_len,
                                          window, documents, m.attn_logit_softcap, parts):
        shown = m.attention if m.attention == kernel else f"{m.attention} ({kernel} here)"
        fail("model.attention", shown, problem)
    if problem := REMATS[m.remat].problem(platform):
        fail("model.remat", m.remat, problem)
    moe_lib.check(c, platform)
    if m.moe.num_experts:
        router_lib.check(c)
    mla_lib.check(c, platform=platform)
    mtp_lib.check(c)
    if m.mtp.depths and documents:
        fail("model.mtp.depths", m.mtp.depths, f"predicts across packed documents' bounds: "
             f"data.packing={c.data.packing!r} packs them; use a layout without document "
             "masks, or 0")
    lora_lib.check(c)
    _check_linear(c, documents)


def _check_linear(c, documents: bool) -> None:
    """Partial RoPE, and the linear-attention layers' shape and what they cannot run with."""
    m = c.model
    head_dim = m.head_dim or m.d_model // m.num_heads
    rotary = int(head_dim * m.partial_rotary_factor)
    if not 0 < m.partial_rotary_factor <= 1 or rotary % 2:
        fail("model.partial_rotary_factor", m.partial_rotary_factor, f"must be in (0, 1] and "
             f"rotate an even number of model.head_dim={head_dim}'s features")
    if not linear_layers(m):
        return
    linear_lib.check(m)
    for key, value, why in (
            ("model.moe.num_experts", m.moe.num_experts, "MoE beside linear_attention layers "
             "is not implemented yet; use 0"),
            ("model.mla.kv_lora_rank", m.mla.kv_lora_rank, "MLA beside linear_attention "
             "layers is not implemented; use 0"),
            ("model.mtp.depths", m.mtp.depths, "MTP beside linear_attention layers is not "
             "implemented; use 0"),
            ("model.lora.rank", m.lora.rank, "LoRA's adapters are not mapped onto the "
             "linear_attention layers' projections yet; use 0 (a full fine-tune)"),
            ("data.packing", c.data.packing if documents else "", "packs documents, whose "
             "bounds the linear_attention layers' recurrence would cross; use a layout "
             "without document masks")):
        if value:
            fail(key, value, why)


def _check_eval(c) -> None:
    """Downstream tasks in the loop: only what is known before the tasks load (their names
    are checked when the run loads them, still before anything compiles)."""
    e = c.eval
    for key, low in (("tasks_every_steps", 0), ("tasks_limit", 0), ("tasks_batch", 1),
                     ("tasks_num_fewshot", -1)):
        if e[key] < low:
            fail(f"eval.{key}", e[key], f"must be >= {low}")
    if str(e.tasks).strip():
        BACKENDS[e.backend].check("eval.backend")
        check_text(c)


def _check_on_mesh(c, sizes: dict[str, int], platform: str | None) -> None:
    """Each chosen registry entry's own rules against the mesh sizes (what it cannot run
    under); mesh.py checks only what the sizes must divide."""
    m = c.model
    PIPELINE_SCHEDULES[c.pipeline.schedule].validate(c, sizes)
    if m.attention != "auto":
        KERNELS[m.attention].check_mesh(c, sizes)
    if sizes["context"] > 1 and FAMILIES[m.family].kernel_parts:
        fail("model.family", m.family, f"its attention parts {FAMILIES[m.family].kernel_parts} "
             f"run inside the kernel, and the context-parallel attention (mesh.context="
             f"{sizes['context']}) has none of them; use mesh.context=1")
    for axis in ("pipeline", "context"):
        if sizes[axis] > 1 and linear_layers(m):
            fail("model.layer_types", m.layer_types, f"has linear_attention layers, which "
                 f"mesh.{axis}={sizes[axis]} cannot split (their recurrence runs along the "
                 f"whole sequence through every layer); use mesh.{axis}=1")
    if sizes["pipeline"] > 1 and len(set(layer_pattern(m.layer_types, m.num_layers))) > 1:
        fail("model.layer_types", m.layer_types, f"mixes layer kinds, which the walker runs "
             f"as one scan per run of equal kinds; mesh.pipeline={sizes['pipeline']} needs "
             "one kind in every layer (use mesh.pipeline=1)")
    if sizes["context"] > 1:
        variant = resolve_variant(m.context_attention, m.num_heads,
                                  m.num_kv_heads or m.num_heads)
        CONTEXT_VARIANTS[variant].validate(c, sizes)
    if m.moe.num_experts:
        dispatch = moe_lib.resolve_dispatch(m.moe.dispatch, platform or "")
        moe_lib.DISPATCHES[dispatch].validate(c, sizes)
    mla_lib.check(c, sizes, platform)
    if m.mtp.depths and sizes["context"] > 1:
        fail("model.mtp.depths", m.mtp.depths, f"shifts tokens along the row, which "
             f"mesh.context={sizes['context']} splits and reorders; use mesh.context=1 or 0")
    BACKENDS[c.eval.backend].check_mesh(c, sizes)


def _check_batch(c, sizes: dict[str, int]) -> None:
    t = c.train
    if t.microbatches < 1 or t.global_batch % t.microbatches:
        fail("train.microbatches", t.microbatches,
             f"must divide train.global_batch={t.global_batch}: one of "
             f"{divisors(t.global_batch)}")
    shards = batch_shards(sizes)
    text = "×".join(f"mesh.{a}" for a, entry in AXES.items() if entry.batch)
    if sizes["pipeline"] > 1:
        shards *= c.pipeline.microbatches
        text += "×pipeline.microbatches"
    micro = t.global_batch // t.microbatches
    if micro % shards:
        fail("train.global_batch", t.global_batch,
             f"each of the {t.microbatches} micro-batches ({micro} sequences) must divide "
             f"by {text}={shards}; try {shards * t.microbatches * max(1, round(micro / shards))}")


def validate(c: ml_collections.ConfigDict, num_devices: int,
             platform: str | None = None) -> dict[str, int]:
    """Raises ConfigError for the first impossible setting; returns the mesh axis sizes.

    platform: the devices' platform ('cpu', 'gpu', 'tpu'), for the choices that depend on
    it (attention kernels, remat offload); None checks only what holds everywhere."""
    _check_paths(c)
    _check_numbers(c)
    for key, registry in (("model.family", FAMILIES), ("model.attention", ("auto", *KERNELS)),
                          ("model.remat", REMATS), ("train.precision", PRECISIONS),
                          ("optimizer.schedule", SCHEDULES), ("data.source", SOURCES),
                          ("eval.backend", BACKENDS), ("data.packing", LAYOUTS),
                          ("model.context_attention", ("auto", *CONTEXT_VARIANTS)),
                          ("pipeline.schedule", PIPELINE_SCHEDULES),
                          ("optimizer.name", OPTIMIZERS), ("train.objective", OBJECTIVES)):
        _choice(c, key, tuple(registry))
    objectives_lib.check(c)
    _check_model(c, platform)
    _check_eval(c)
    validate_sinks(c)
    SOURCES[c.data.source].validate(c)
    OPTIMIZERS[c.optimizer.name].validate(c)
    sizes = resolve_mesh_shape(c.mesh, num_devices)
    validate_axes(c, sizes)
    _check_on_mesh(c, sizes, platform)
    _check_batch(c, sizes)
    return sizes
