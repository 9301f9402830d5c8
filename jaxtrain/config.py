"""Config defaults and validation.

Every config file in configs/ starts from `base_config()` and overrides what it needs, so the
set of keys is defined here once. `validate()` catches impossible combinations before anything
compiles and names the key with the values that would be valid. Each extensible choice (model
family, attention kernel, remat policy, precision, data source, mesh axis, schedule) is a
registry entry in the module that implements it, carrying its own checks; validate() asks
the registries, so this module sits above them and they never import it.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

from jaxtrain.data.packing import PACKINGS
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
from jaxtrain.models import moe as moe_lib
from jaxtrain.models import rope as rope_lib
from jaxtrain.models.attention import KERNELS, resolve_attention, resolve_variant
from jaxtrain.models.attention import VARIANTS as CONTEXT_VARIANTS
from jaxtrain.models.families import FAMILIES
from jaxtrain.models.remat import REMATS
from jaxtrain.objectives import OBJECTIVES
from jaxtrain.optim import OPTIMIZERS, SCHEDULES
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
    c = ml_collections.ConfigDict()
    c.name = "base"
    c.steps = 100
    c.seed = 0
    c.log_every_steps = 10
    c.eval_every_steps = 50
    c.eval_batches = 4

    c.mesh = ml_collections.ConfigDict()
    for axis in AXES:  # mesh.NAME: size within a node or slice; -1: the rest of the devices
        c.mesh[axis] = -1 if axis == "data" else 1
    c.mesh.sequence_parallel = False
    # mesh.context > 1: each device holds 2 chunks of the row, i and 2C-1-i, so that causal
    # attention work is equal on every device (parallel/context.py); False: a plain split.
    c.mesh.context_load_balance = True
    # Sizes across the slow links between hosts/slices (DCN); the plain sizes are within one.
    for axis in AXES:
        c.mesh[f"dcn_{axis}"] = 1
    c.mesh.rules = DEFAULT_RULES

    # Used when mesh.pipeline > 1 (see docs/parallelism.md).
    c.pipeline = ml_collections.ConfigDict()
    c.pipeline.schedule = "gpipe"
    # Pipeline micro-batches: the slices of each (accumulation) micro-batch that flow through
    # the stages; not train.microbatches, which is gradient accumulation.
    c.pipeline.microbatches = 4
    c.pipeline.repeats = 1  # layer chunks per stage; circular only

    c.model = ml_collections.ConfigDict()
    c.model.family = "gpt2"
    c.model.d_model = 128
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 0  # 0: same as num_heads
    c.model.head_dim = 0  # 0: d_model // num_heads
    c.model.mlp_dim = 512
    c.model.vocab_size = 256
    c.model.seq_len = 128
    c.model.attention = "auto"  # cudnn on NVIDIA GPUs in bf16/fp16, else chunked
    c.model.sliding_window = 0  # 0: full causal attention; W: each token sees its last W
    # mesh.context > 1: how K/V reach every device (models/attention/context_variants.py): allgather
    # (one all-gather per layer), ring (ppermute hops), auto (allgather under GQA, else ring).
    c.model.context_attention = "auto"
    c.model.remat = "none"
    c.model.rope_theta = 10000.0
    # RoPE scaling for context extension (models/rope.py has every field's meaning); the
    # names are transformers' rope_parameters keys, so HF import/export maps them 1:1.
    c.model.rope_scaling = ml_collections.ConfigDict()
    c.model.rope_scaling.type = "none"  # none | llama3 | yarn
    c.model.rope_scaling.factor = 8.0
    c.model.rope_scaling.original_max_position_embeddings = 8192
    c.model.rope_scaling.low_freq_factor = 1.0  # llama3
    c.model.rope_scaling.high_freq_factor = 4.0  # llama3
    c.model.rope_scaling.beta_fast = 32.0  # yarn
    c.model.rope_scaling.beta_slow = 1.0  # yarn
    c.model.rope_scaling.attention_factor = 0.0  # yarn; 0: 0.1·ln(factor) + 1
    c.model.rope_scaling.truncate = True  # yarn
    c.model.norm_eps = 1e-5
    c.model.init_std = 0.02
    # Mixture of experts (models/moe.py, docs/parallelism.md); num_experts 0: a dense model.
    c.model.moe = ml_collections.ConfigDict()
    c.model.moe.num_experts = 0  # E routed experts per MoE layer (>= 2), llama family
    c.model.moe.top_k = 2  # experts per token; their router probabilities renormalised
    c.model.moe.expert_mlp_dim = 0  # each expert's SwiGLU width; 0: model.mlp_dim
    c.model.moe.shared_experts = 0  # always-on experts of expert_mlp_dim (DeepSeek/Qwen)
    c.model.moe.every_n_layers = 1  # layers n-1, 2n-1, ... are MoE, the rest dense
    c.model.moe.router_dtype = "float32"  # the router's matmul (softmax is always float32)
    c.model.moe.aux_loss_weight = 0.01  # load balancing: (E/k)·Σ f·P, 1.0 when balanced
    c.model.moe.z_loss_weight = 0.001  # router z-loss: mean logsumexp(logits)²
    # capacity dispatch: an expert takes at most ⌈capacity_factor·T·k/E⌉ of a device's T
    # tokens, the rest are dropped (moe_dropped_fraction in metrics.jsonl).
    c.model.moe.capacity_factor = 1.25
    # auto: dropless on TPU (grouped matmuls), capacity on CPU and GPU; or either by name.
    c.model.moe.dispatch = "auto"

    # LoRA (models/lora.py, docs/finetune.md): rank 0 trains every weight.
    c.model.lora = ml_collections.ConfigDict()
    c.model.lora.rank = 0  # the adapters' rank; 0: off
    c.model.lora.alpha = 16.0  # their output is scaled by alpha/rank (as PEFT's lora_alpha)
    c.model.lora.targets = lora_lib.DEFAULT_TARGETS  # comma list: q,k,v,o,up,gate,down,experts
    c.model.lora.dropout = 0.0  # only 0.0 (no dropout) is implemented
    # The frozen base: a run directory (local, gs://, s3://) whose newest checkpoint's
    # parameters it is (jaxtrain convert --from-hf ... --workdir BASE, or any training
    # run); empty: the base is initialised from `seed` (tests, benchmarks).
    c.model.lora.base = ""
    c.train = ml_collections.ConfigDict()
    c.train.global_batch = 8
    # Gradient accumulation: the global batch is split into this many micro-batches, run one
    # after another and their gradients summed (pipeline.microbatches is another thing).
    c.train.microbatches = 1
    c.train.precision = "float32"
    c.train.max_consecutive_bad_steps = 5  # non-finite steps in a row before the run stops
    # Hang watchdog: no step (or evaluation, or checkpoint save) completing for this long
    # dumps every thread's stack and exits with code 4; 0: off.
    c.train.step_timeout_s = 1800.0
    c.train.mfu_floor = 0.0  # warn when a logged step's MFU is below this; 0: never
    # float16 only: dynamic loss scaling, doubled after this many finite steps in a row.
    c.train.loss_scale_init = 2.0**15
    c.train.loss_scale_period = 2000
    # What the step minimises (objectives.py OBJECTIVES, docs/finetune.md): lm (next-token
    # cross entropy) or dpo (preference pairs, data.packing='pairs', against a frozen
    # reference: LoRA's base, or train.dpo.reference's parameters, also the starting ones).
    c.train.objective = "lm"
    c.train.dpo = ml_collections.ConfigDict()
    c.train.dpo.beta = 0.1  # the strength of the implicit KL penalty (TRL's beta)
    c.train.dpo.reference = ""  # a run directory; empty: the model initialised from seed

    # A jax.profiler trace (TensorBoard/Perfetto) of steps [start_step, start_step+num_steps)
    # and a device memory profile, in WORKDIR/profile; start_step -1: none.
    c.profile = ml_collections.ConfigDict()
    c.profile.start_step = -1
    c.profile.num_steps = 3

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adamw"  # optim.py OPTIMIZERS: adamw, lion
    c.optimizer.lr = 3e-4
    c.optimizer.warmup_steps = 10
    c.optimizer.schedule = "cosine"
    c.optimizer.min_lr_ratio = 0.1
    c.optimizer.weight_decay = 0.1
    c.optimizer.decay_embeddings = False
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.eps = 1e-8
    c.optimizer.clip_norm = 1.0
    # Keep the Adam moments in pinned host memory between steps (GPU/TPU memory saver).
    c.optimizer.offload_to_host = False

    c.data = ml_collections.ConfigDict()
    c.data.source = "stdlib"
    # bin: a .bin file or a directory with train.bin/val.bin; prepared: a directory made by
    # `jaxtrain prepare` (docs/data.md).
    c.data.path = ""
    c.data.dtype = "uint16"  # token width of .bin files
    c.data.val_fraction = 0.05  # held-out tail (prepared: at a document boundary)
    c.data.prefetch = 2
    # concat: rows are windows of the concatenated documents; documents: whole documents
    # packed into rows, attention and positions kept within each (docs/data.md).
    c.data.packing = "concat"
    # prepared: several datasets drawn by weight, "DIR:WEIGHT,DIR:WEIGHT" (instead of path).
    c.data.mixture = ""
    # prepared: validate on this prepared dataset instead of a held-out tail.
    c.data.val_path = ""
    # bin: the tokenizer that made the ids (a spec as for prepare --tokenizer), so that
    # generate/eval/convert can use text; prepared datasets carry their own.
    c.data.tokenizer = ""
    # Resume even though the data's fingerprint changed since the run started (data.json).
    c.data.allow_changed = False
    # Data on gs:// or s3:// (docs/data.md): read by range requests of block_kb KiB into an
    # in-memory LRU cache of cache_mb MiB per process (jaxtrain.data.remote_file).
    c.data.cache_mb = 512
    c.data.block_kb = 256

    # Downstream tasks during training (docs/evaluation.md): scored on the live parameters
    # every tasks_every_steps and at the end, logged beside val_loss as tasks/TASK/METRIC.
    c.eval = ml_collections.ConfigDict()
    c.eval.tasks = ""  # comma-separated task names, task YAML or JSONL files; "": none
    c.eval.tasks_every_steps = 0  # 0: only at the end of the run
    c.eval.task_dir = ""  # comma-separated directories of task YAML files
    c.eval.tasks_limit = 0  # documents per task; 0: all
    c.eval.tasks_num_fewshot = -1  # -1: each task's own default
    c.eval.tasks_batch = 8  # rows per scoring batch (rounded up to what the mesh splits)
    c.eval.backend = "lm_eval"

    # Where logged metrics go (jaxtrain/sinks.py); metrics.jsonl always.
    c.metrics = ml_collections.ConfigDict()
    c.metrics.sinks = "jsonl,tensorboard"  # add wandb for Weights & Biases
    c.metrics.wandb = ml_collections.ConfigDict()
    c.metrics.wandb.project = "jaxtrain"
    c.metrics.wandb.entity = ""  # "": the account's default
    c.metrics.wandb.run_name = ""  # "": the workdir's name
    c.metrics.wandb.mode = "online"  # offline: no network (`wandb sync` later); disabled

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 0  # 0: only at the end of the run
    c.checkpoint.keep = 3  # healthy checkpoints kept (docs/operations.md)
    c.checkpoint.keep_period = 0  # also keep every N-th step forever; 0: none
    # A second, fast tier (a local SSD; for a multi-process job, a directory every process
    # sees): saved every local_every_steps, keeping local_keep. Restore takes the newest
    # intact step of either tier.
    c.checkpoint.local_dir = ""
    c.checkpoint.local_every_steps = 0
    c.checkpoint.local_keep = 2
    c.checkpoint.verify_on_restore = True  # check every file's checksum before restoring

    # Multi-process jobs: a process whose peer stops answering exits (non-zero) after this
    # long, so that the scheduler can restart the job (docs/multihost.md).
    c.distributed = ml_collections.ConfigDict()
    c.distributed.heartbeat_timeout_s = 60
    c.distributed.initialization_timeout_s = 300

    # Test-only fault injection (train/faults.py): a NaN loss at steps
    # [nan_from_step, nan_from_step + nan_steps); the input of step hang_at_step never comes.
    c.debug = ml_collections.ConfigDict()
    c.debug.nan_from_step = -1
    c.debug.nan_steps = 1
    c.debug.hang_at_step = -1
    return c


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
                        ("train.dpo.reference", [c.train.dpo.reference])):
        for value in values:
            check_path(value, key)
    check_cache_config(c)
    for key, values in (("data.tokenizer", [d.tokenizer]),
                        ("checkpoint.local_dir", [c.checkpoint.local_dir]),
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
    if c.data.packing == "documents" and m.seq_len < 2:
        fail("model.seq_len", m.seq_len, "data.packing='documents' needs >= 2")
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
    heads, kv_heads = m.num_heads, m.num_kv_heads or m.num_heads
    if heads % kv_heads:
        fail("model.num_kv_heads", m.num_kv_heads,
             f"must divide model.num_heads={heads}: one of {divisors(heads)}")
    if not m.head_dim and m.d_model % heads:
        fail("model.num_heads", heads, f"must divide model.d_model={m.d_model} "
             "(or set model.head_dim)")
    FAMILIES[m.family].check(m.head_dim or m.d_model // heads)
    rope_lib.check(m.rope_scaling)
    if m.rope_scaling.type != "none" and not FAMILIES[m.family].rope:
        fail("model.rope_scaling.type", m.rope_scaling.type, f"model.family={m.family!r} has "
             "learned positions, no RoPE: use none")
    documents = c.data.packing == "documents"
    kernel = resolve_attention(m.attention, c.train.precision, platform or "", m.seq_len,
                               m.sliding_window, documents)
    if problem := KERNELS[kernel].problem(c.train.precision, platform, m.seq_len,
                                          m.sliding_window, documents):
        shown = m.attention if m.attention == kernel else f"{m.attention} ({kernel} here)"
        fail("model.attention", shown, problem)
    if problem := REMATS[m.remat].problem(platform):
        fail("model.remat", m.remat, problem)
    moe_lib.check(c, platform)
    lora_lib.check(c)


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
    if sizes["context"] > 1:
        variant = resolve_variant(m.context_attention, m.num_heads,
                                  m.num_kv_heads or m.num_heads)
        CONTEXT_VARIANTS[variant].validate(c, sizes)
    if m.moe.num_experts:
        dispatch = moe_lib.resolve_dispatch(m.moe.dispatch, platform or "")
        moe_lib.DISPATCHES[dispatch].validate(c, sizes)
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
                          ("eval.backend", BACKENDS), ("data.packing", PACKINGS),
                          ("model.context_attention", ("auto", *CONTEXT_VARIANTS)),
                          ("pipeline.schedule", PIPELINE_SCHEDULES),
                          ("optimizer.name", OPTIMIZERS), ("train.objective", OBJECTIVES)):
        _choice(c, key, tuple(registry))
    OBJECTIVES[c.train.objective].check(c)
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
