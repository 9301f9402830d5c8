"""Config defaults, choices and validation.

Every config file in configs/ starts from `base_config()` and overrides what it needs, so the
set of keys is defined here once. `validate()` catches impossible combinations before anything
compiles and names the key with the values that would be valid.
"""

from __future__ import annotations

import math

import ml_collections

FAMILIES = ("gpt2", "llama")
ATTENTIONS = ("auto", "xla", "chunked", "cudnn", "pallas", "splash")
REMATS = ("none", "full", "save_dots", "save_dots_except_mlp", "save_attention_out",
          "offload_dots")
PRECISIONS = ("float32", "bfloat16", "float16", "fp8")
SCHEDULES = ("cosine", "linear", "constant")
SOURCES = ("stdlib", "bin", "synthetic")
PIPELINE_SCHEDULES = ("gpipe", "circular")
MESH_AXES = ("data", "pipeline", "fsdp", "tensor")

# Logical axis -> mesh axes. For each logical dimension of an array the first rule whose mesh
# axes are not already used by an earlier dimension of the same array applies; a dimension
# with no usable rule is replicated. That is how 'embed' is fsdp-sharded in a weight but
# replicated in an activation whose 'batch' already took fsdp.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    # The residual stream's length between blocks; used only when mesh.sequence_parallel.
    ("sequence", "tensor"),
    # The stacked layers of the model, and the stage axis of the pipeline's buffers.
    ("layers", "pipeline"),
    ("stage", "pipeline"),
)


class ConfigError(ValueError):
    """A config value that cannot work; the message is one line naming the key."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "base"
    c.steps = 100
    c.seed = 0
    c.log_every_steps = 10
    c.eval_every_steps = 50
    c.eval_batches = 4

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.pipeline = 1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.sequence_parallel = False
    # Sizes across the slow links between hosts/slices (DCN); the plain sizes are within one.
    c.mesh.dcn_data = 1
    c.mesh.dcn_pipeline = 1
    c.mesh.dcn_fsdp = 1
    c.mesh.dcn_tensor = 1
    c.mesh.rules = DEFAULT_RULES

    # Used when mesh.pipeline > 1 (see docs/parallelism.md).
    c.pipeline = ml_collections.ConfigDict()
    c.pipeline.schedule = "gpipe"
    c.pipeline.microbatches = 4  # per train step (per accumulation micro-batch)
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
    c.model.remat = "none"
    c.model.rope_theta = 10000.0
    c.model.norm_eps = 1e-5
    c.model.init_std = 0.02

    c.train = ml_collections.ConfigDict()
    c.train.global_batch = 8
    c.train.microbatches = 1
    c.train.precision = "float32"
    c.train.max_consecutive_bad_steps = 5  # non-finite steps in a row before the run stops
    c.train.mfu_floor = 0.0  # warn when a logged step's MFU is below this; 0: never
    # float16 only: dynamic loss scaling, doubled after this many finite steps in a row.
    c.train.loss_scale_init = 2.0**15
    c.train.loss_scale_period = 2000

    # A jax.profiler trace (TensorBoard/Perfetto) of steps [start_step, start_step+num_steps)
    # and a device memory profile, in WORKDIR/profile; start_step -1: none.
    c.profile = ml_collections.ConfigDict()
    c.profile.start_step = -1
    c.profile.num_steps = 3

    c.optimizer = ml_collections.ConfigDict()
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
    c.data.path = ""
    c.data.dtype = "uint16"  # token width of .bin files
    c.data.val_fraction = 0.05
    c.data.prefetch = 2

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 0  # 0: only at the end of the run
    c.checkpoint.keep = 3
    c.checkpoint.keep_period = 0  # also keep every N-th step forever; 0: none

    # Test-only fault injection: a NaN loss at steps [nan_from_step, nan_from_step+nan_steps).
    c.debug = ml_collections.ConfigDict()
    c.debug.nan_from_step = -1
    c.debug.nan_steps = 1
    return c


def load_config_file(path) -> ml_collections.ConfigDict:
    """get_config() of a config file, as --config loads it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_config_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def apply_overrides(c: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """Sets dotted keys ({"model.d_model": 64}), as --config.KEY=VALUE does."""
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return c


def _fail(key: str, value, valid: str) -> None:
    raise ConfigError(f"{key}={value!r} is invalid: {valid}")


def _choice(c, key: str, choices) -> None:
    value = c
    for part in key.split("."):
        value = value[part]
    if value not in choices:
        _fail(key, value, f"valid values are {', '.join(choices)}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def dcn_shape(mesh_cfg) -> dict[str, int]:
    """Per-axis sizes across the slow links (between hosts or slices); 1 where unused."""
    return {axis: int(mesh_cfg[f"dcn_{axis}"]) for axis in MESH_AXES}


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    """Total mesh axis sizes (within-node size × dcn size), the one -1 filled so that they
    multiply to num_devices."""
    dcn = dcn_shape(mesh_cfg)
    for axis, size in dcn.items():
        if size < 1:
            _fail(f"mesh.dcn_{axis}", size, "must be >= 1")
    if dcn["tensor"] != 1:
        _fail("mesh.dcn_tensor", dcn["tensor"], "tensor parallelism needs fast links: keep it "
              "within a node (mesh.tensor) and put data, fsdp or pipeline across nodes")
    granules = math.prod(dcn.values())
    if num_devices % granules:
        _fail("mesh", f"dcn sizes multiplying to {granules}", f"must divide the {num_devices} "
              "devices")
    per_granule = num_devices // granules
    sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            _fail(f"mesh.{axis}", size, "a positive size, or -1 for 'the rest'")
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        _fail(f"mesh.{free[1]}", -1, f"only one axis may be -1 (mesh.{free[0]} already is)")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    where = f"the {per_granule} devices of each of the {granules} dcn groups" if granules > 1 \
        else f"the {num_devices} devices"
    if free:
        if per_granule % fixed:
            _fail(f"mesh.{free[0]}", -1, f"the other axes multiply to {fixed}, "
                  f"which does not divide {where}")
        sizes[free[0]] = per_granule // fixed
    elif fixed != per_granule:
        shown = "×".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "1"
        _fail("mesh", shown, f"the mesh axes must multiply to {where} "
              f"(got {fixed}); set one axis to -1 to fill the rest")
    return {axis: sizes[axis] * dcn[axis] for axis in MESH_AXES}


def validate(c: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """Raises ConfigError for the first impossible setting; returns the mesh axis sizes."""
    for key in ("steps", "log_every_steps", "eval_every_steps", "eval_batches"):
        if c[key] < 1:
            _fail(key, c[key], "must be >= 1")
    m, t = c.model, c.train
    _choice(c, "model.family", FAMILIES)
    _choice(c, "model.attention", ATTENTIONS)
    _choice(c, "model.remat", REMATS)
    _choice(c, "train.precision", PRECISIONS)
    _choice(c, "optimizer.schedule", SCHEDULES)
    _choice(c, "data.source", SOURCES)
    if m.attention == "cudnn" and c.train.precision == "float32":
        _fail("model.attention", m.attention, "cuDNN flash attention needs "
              "train.precision=bfloat16; use xla or chunked for float32")
    if c.data.dtype not in ("uint16", "uint32"):
        _fail("data.dtype", c.data.dtype, "valid values are uint16, uint32")
    for key in ("d_model", "num_layers", "num_heads", "mlp_dim", "vocab_size", "seq_len"):
        if m[key] < 1:
            _fail(f"model.{key}", m[key], "must be >= 1")
    if m.sliding_window < 0:
        _fail("model.sliding_window", m.sliding_window, "must be 0 (off) or a window >= 1")
    heads, kv_heads = m.num_heads, m.num_kv_heads or m.num_heads
    if heads % kv_heads:
        _fail("model.num_kv_heads", m.num_kv_heads,
              f"must divide model.num_heads={heads}: one of {_divisors(heads)}")
    if not m.head_dim and m.d_model % heads:
        _fail("model.num_heads", heads, f"must divide model.d_model={m.d_model} "
              "(or set model.head_dim)")
    if m.family == "llama" and (m.head_dim or m.d_model // heads) % 2:
        _fail("model.head_dim", m.head_dim or m.d_model // heads, "RoPE needs an even head_dim")
    if c.data.source == "stdlib" and m.vocab_size < 256:
        _fail("model.vocab_size", m.vocab_size, "the byte-level stdlib corpus needs >= 256")
    if c.data.source == "bin" and not c.data.path:
        _fail("data.path", "", "data.source='bin' needs a .bin file or a directory "
              "holding train.bin and val.bin")
    if not 0.0 < c.data.val_fraction < 1.0:
        _fail("data.val_fraction", c.data.val_fraction, "must be between 0 and 1")
    if c.optimizer.lr <= 0:
        _fail("optimizer.lr", c.optimizer.lr, "must be > 0")
    if c.optimizer.warmup_steps < 0:
        _fail("optimizer.warmup_steps", c.optimizer.warmup_steps, "must be >= 0")
    for key, low in (("every_steps", 0), ("keep", 1), ("keep_period", 0)):
        if c.checkpoint[key] < low:
            _fail(f"checkpoint.{key}", c.checkpoint[key], f"must be >= {low}")
    if c.train.loss_scale_init <= 0 or c.train.loss_scale_period < 1:
        _fail("train.loss_scale_init", c.train.loss_scale_init, "loss_scale_init must be > 0 "
              "and loss_scale_period >= 1")
    if c.profile.num_steps < 1:
        _fail("profile.num_steps", c.profile.num_steps, "must be >= 1")
    if c.train.max_consecutive_bad_steps < 1:
        _fail("train.max_consecutive_bad_steps", c.train.max_consecutive_bad_steps,
              "must be >= 1")

    sizes = resolve_mesh_shape(c.mesh, num_devices)
    _validate_pipeline(c, sizes["pipeline"])
    tensor, fsdp = sizes["tensor"], sizes["fsdp"]
    for key, value in (("num_heads", heads), ("num_kv_heads", kv_heads),
                       ("mlp_dim", m.mlp_dim), ("vocab_size", m.vocab_size)):
        if value % tensor:
            _fail(f"model.{key}", value, f"must be divisible by mesh.tensor={tensor}")
    if m.d_model % fsdp:
        _fail("model.d_model", m.d_model, f"must be divisible by mesh.fsdp={fsdp}")
    if c.mesh.sequence_parallel and m.seq_len % tensor:
        _fail("model.seq_len", m.seq_len, f"must be divisible by mesh.tensor={tensor} "
              "under mesh.sequence_parallel")
    if t.microbatches < 1 or t.global_batch % t.microbatches:
        _fail("train.microbatches", t.microbatches,
              f"must divide train.global_batch={t.global_batch}: one of "
              f"{_divisors(t.global_batch)}")
    batch_shards = sizes["data"] * fsdp
    if sizes["pipeline"] > 1:
        batch_shards *= c.pipeline.microbatches
    shards_text = "mesh.data×mesh.fsdp" + ("×pipeline.microbatches" if sizes["pipeline"] > 1
                                           else "")
    micro = t.global_batch // t.microbatches
    if micro % batch_shards:
        _fail("train.global_batch", t.global_batch,
              f"each of the {t.microbatches} micro-batches ({micro} sequences) must divide "
              f"by {shards_text}={batch_shards}; try "
              f"{batch_shards * t.microbatches * max(1, round(micro / batch_shards))}")
    return sizes


def _validate_pipeline(c, stages: int) -> None:
    pc = c.pipeline
    _choice(c, "pipeline.schedule", PIPELINE_SCHEDULES)
    if pc.microbatches < 1:
        _fail("pipeline.microbatches", pc.microbatches, "must be >= 1")
    if pc.schedule == "gpipe" and pc.repeats != 1:
        _fail("pipeline.repeats", pc.repeats, "the gpipe schedule has one chunk per stage: "
              "use 1, or pipeline.schedule='circular'")
    if pc.schedule == "circular" and pc.repeats < 2:
        _fail("pipeline.repeats", pc.repeats, "the circular schedule needs >= 2 chunks per stage")
    if stages == 1:
        return
    if pc.schedule == "circular" and pc.microbatches < stages:
        _fail("pipeline.microbatches", pc.microbatches,
              f"the circular schedule needs at least mesh.pipeline={stages} micro-batches")
    chunks = stages * pc.repeats
    layers = c.model.num_layers
    if layers % chunks:
        below, above = layers - layers % chunks, layers + chunks - layers % chunks
        options = [str(n) for n in (below, above) if n > 0]
        repeats = [r for r in range(2, layers + 1) if layers % (stages * r) == 0]
        hint = f"; or pipeline.repeats in {repeats}" if repeats and pc.schedule == "circular" \
            else ""
        _fail("model.num_layers", layers, f"must divide into mesh.pipeline×pipeline.repeats="
              f"{stages}×{pc.repeats} equal stages: use {' or '.join(options)}{hint}")
