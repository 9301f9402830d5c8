"""Per-device memory of one train step, from the config alone (no devices, no compile).

Model state is counted exactly: every parameter's shape and logical axes come from the
abstract model, and the config's rules say how each dimension is split over the mesh.
Activations follow the code's own structure (models/transformer.py, head_loss.py,
parallel/pipeline.py) with per-tensor counts written out below; docs/planner.md gives the
formulas and the comparison with XLA's compiled memory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

import jax
from flax import nnx

from jaxtrain.mesh import batch_shards, logical_to_spec
from jaxtrain.models import ModelSpec, Transformer, base_storage, lora
from jaxtrain.models.attention import KERNELS, VARIANTS
from jaxtrain.models.moe import DISPATCHES
from jaxtrain.models.remat import REMATS
from jaxtrain.objectives import OBJECTIVES, document_masks
from jaxtrain.optim import OPTIMIZERS

F32 = 4
# How close the estimate is held to XLA's compiled figure (estimate / XLA) on every stored
# compiled step (plan/memory_fit.py, tests/unit/test_plan.py).
TARGET = (0.85, 1.15)
# The mesh axes parameters are sharded over only to be all-gathered before use (ZeRO-3):
# fsdp, and context (mesh.py's rules).
ZERO_AXES = ("fsdp", "context")
# Copies of the routed rows ([R, D]) an MoE layer holds: kept for backward (the rows the
# experts read), and while it runs (gathered rows, the exchanged buffers in and out, the
# regrouped rows, the experts' output).
MOE_ROW_COPIES_KEPT = 1.0
MOE_ROW_COPIES = 4.0


@dataclasses.dataclass(frozen=True)
class Factors:
    """What the counting below cannot know and XLA's buffer assignments show, fitted per
    compiler on its compiled steps (plan/memory_fit.json, plan/calibrate/fit_memory.py):
    XLA:CPU's on the test grid, the shipped configs and the published layouts; the TPU
    compiler's (libtpu, AOT) on the published TPU layouts. GPUs use the CPU set (no GPU
    compile here)."""

    # Buffers XLA holds besides the ones counted (fusion outputs, copies around collectives,
    # the optimizer's update tree), as a fraction of the counted temporaries,
    temp_margin: float = 0.05
    # and of the peak phase's alone (below: its fusion outputs and layout copies).
    peak_margin: float = 0.0
    # float32 score matrices (one query chunk against its keys) alive at once in the
    # unrolled chunked kernel: a fixed number plus some per query chunk (XLA overlaps the
    # chunks' buffers);
    chunk_scores: float = 0.0
    chunk_scores_per_chunk: float = 1.5
    # and float32 [query chunk, key block] tiles alive in its looped form.
    loop_tiles: float = 4.0
    # The share of one layer's full set of activations alive while it is recomputed and run
    # backward: under full remat, and (of what save_dots did not save) under save_dots.
    full_working: float = 0.75
    dots_working: float = 0.75
    # The share of a layer's full set of activations its backward pass holds as their
    # gradients, whatever the remat policy (without remat this is its whole working set:
    # XLA's live-range dump of torchtitan's llama2-13b layout shows 5.2 GB in one layer's
    # backward, docs/planner.md).
    grad_working: float = 0.0
    # float32 [tokens, heads + kv_heads, head_dim] arrays while a layer's attention runs:
    # RoPE rotates q and k in float32 (models/rope.py), forward and backward.
    rope_f32: float = 0.0
    # Copies of the residual stream ([rows, seq, d_model]) around the head: the last layer's
    # output, the final norm's, their gradients, layout changes.
    head_stream: float = 1.0
    # float32-sized arrays per logit of the head's chunk (the logits; their gradient is
    # counted at the compute dtype on top).
    logit_f32: float = 1.0
    # Compute-dtype copies of the gathered output head alive around the loss: the cast of
    # the gathered shard, and when tied its transposed copy (Gemma 3's 262K×3840 table is
    # 4 GB a copy in float32, where the smaller vocabularies hid the count).
    head_copies: float = 1.0
    # The share of a layer's gathered weights (compute dtype) alive while it runs backward,
    layer_weights: float = 1.0
    # and of their float32 gradients.
    layer_weight_grads: float = 1.0
    # The share of the smaller of the step's two peaks (a layer's backward pass, the head
    # and loss) alive at the larger's.
    phase_overlap: float = 1.0
    # float32 copies of a pipeline stage's weight stack (layout changes around the loop).
    pipeline_weight_copies: float = 2.0
    # What XLA holds per routed MoE row over the copies counted: kept (no remat) and while a
    # layer runs (the dispatch's gathers become float32 scatter-adds in backward, its masked
    # and exchanged buffers and their gradients live alongside).
    moe_row_factor: float = 2.5
    moe_working_factor: float = 2.0


FIT_FILE = os.path.join(os.path.dirname(__file__), "memory_fit.json")


@functools.lru_cache(maxsize=1)
def _fit_data() -> dict:
    with open(FIT_FILE) as f:
        return json.load(f)


def fitted() -> dict[str, Factors]:
    """{'cpu': Factors, 'tpu': Factors} from plan/memory_fit.json."""
    return {name: Factors(**values) for name, values in _fit_data()["factors"].items()}


def compiler_of(platform: str) -> str:
    """Whose fitted set a platform uses: TPU's own; XLA:CPU's for CPU and GPU."""
    return "tpu" if platform == "tpu" else "cpu"


def factors_for(platform: str) -> Factors:
    """The fitted set a platform's estimate uses (compiler_of)."""
    return fitted()[compiler_of(platform)]


def uncertainty(platform: str) -> str:
    """How close the estimate came to the compiler on the steps its factors were fitted on,
    and on the ones held out of the fit (plan/memory_fit.json, plan/calibrate/fit_memory.py
    --write and --holdout K --write), in a plan's words."""
    source, data = compiler_of(platform), _fit_data()
    compiler = "libtpu (TPU AOT)" if source == "tpu" else "XLA:CPU"
    text = "estimate / XLA: "
    if source in data.get("spread", {}):
        low, high, rows = data["spread"][source]
        text += f"{low:.2f}–{high:.2f} on {rows} {compiler} compiled steps"
    else:
        text += f"not measured against {compiler}"
    if source in data.get("holdout", {}):
        low, high, folds = data["holdout"][source]
        text += f" ({low:.2f}–{high:.2f} held out, {folds}-fold)"
    if platform == "gpu":
        text += "; GPUs use the CPU factors, no GPU compile here"
    return text


def value_bytes(spec: ModelSpec, backend: str = "accelerator") -> int:
    """Bytes per activation (and per gathered weight): the compute dtype's, which is bf16
    under fp8 too (fp8 quantizes inside the matmul); XLA's CPU backend keeps 16-bit
    activations in float32."""
    return F32 if backend == "cpu" else jax.numpy.dtype(spec.compute_dtype).itemsize


@functools.lru_cache(maxsize=256)
def _param_leaves(spec: ModelSpec) -> tuple[tuple[tuple, tuple[int, ...], tuple, bool], ...]:
    """(path, shape, logical axes, trained or frozen) of every parameter. The
    shapes do not depend on the mesh, so a --search over a thousand layouts traces the
    model once, not once a layout (that was 150 s of a 13B search on 64 devices)."""
    model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0)))
    leaves = jax.tree_util.tree_flatten_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return tuple((tuple(k.key for k in path), tuple(var.get_value().shape),
                  tuple(var.get_metadata()["axes"]), _trained(spec, path)) for path, var in leaves)


def frozen_bytes(spec: ModelSpec, path: tuple, shape: tuple, axes: tuple) -> float:
    """Bytes per element of a frozen (LoRA base) parameter as model.lora.base_dtype stores
    it: the entry's matmul_bytes for a block matmul weight, its table_bytes for a table,
    float32 for a vector (models/base_storage.py role)."""
    storage = base_storage.STORAGES[spec.lora.base_dtype]
    role = base_storage.role(path, shape, axes)
    return {"matmul": storage.matmul_bytes, "table": storage.table_bytes,
            "vector": F32}[role]


def _trained(spec: ModelSpec, path) -> bool:
    """Whether the step trains this parameter (LoRA: the adapters alone, models/lora.py)."""
    return spec.lora is None or lora.is_adapter(tuple(k.key for k in path))


def param_shards(spec: ModelSpec, sizes: dict[str, int]) -> dict[str, int]:
    """Elements per device: 'total' parameters, 'stack' (the device's share of the stacked
    layers), 'layer_gathered' (one layer after the ZeRO all-gather), 'head_gathered' (the
    output projection as the head gathers it); 'count': the model's parameters; the
    same three with `_trained`: those the step trains (every one, but LoRA's adapters),
    which alone have gradients and optimizer state; 'frozen_bytes': the bytes of the
    device's share of the frozen ones as stored (LoRA's base: model.lora.base_dtype)."""
    out = {"total": 0, "layer_gathered": 0, "count": 0, "head_gathered": 0, "stack": 0,
           "total_trained": 0, "layer_gathered_trained": 0, "head_gathered_trained": 0,
           "frozen_bytes": 0.0}
    for path, shape, axes, trained in _param_leaves(dataclasses.replace(spec, rules=())):
        name = path[0]
        pspec = logical_to_spec(axes, spec.rules)
        local = gathered = 1
        for dim, mesh_axes in zip(shape, tuple(pspec) + (None,) * len(axes)):
            names = () if mesh_axes is None else (
                (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes))
            local *= math.ceil(dim / math.prod(sizes[a] for a in names))
            kept = [a for a in names if a not in ZERO_AXES]
            gathered *= math.ceil(dim / math.prod(sizes[a] for a in kept))
        out["total"] += local
        out["total_trained"] += local * trained
        if not trained:
            out["frozen_bytes"] += local * frozen_bytes(spec, path, shape, axes)
        out["count"] += math.prod(shape)
        if axes and axes[0] == "layers":
            layers = shape[0]
            out["stack"] += local
            layer = gathered // max(1, math.ceil(layers / sizes["pipeline"]))
            out["layer_gathered"] += layer
            out["layer_gathered_trained"] += layer * trained
        elif name == "lm_head" or (name == "tok_embed" and spec.tied_embeddings):
            out["head_gathered"] += gathered
            out["head_gathered_trained"] += gathered * trained
    return out


def _layer_activations(spec: ModelSpec, rows: float, sizes: dict, saved: str,
                       c: int) -> float:
    """Bytes one layer keeps for backward for `rows` sequences on one device, activations
    of c bytes each.

    saved: 'kept' (no remat policy: what the backward pass keeps), 'dots' (save_dots:
    matmul outputs), 'input' (full remat: the layer's input only), or 'all' (every
    intermediate a layer makes: the working set while a layer is recomputed).
    """
    t, cp = sizes["tensor"], sizes.get("context", 1)
    s, d, f = spec.seq_len, spec.d_model, spec.mlp_dim
    sp = _sequence_parallel(spec)
    # Context parallelism splits every per-position activation C ways; SP the residual
    # stream's share t ways more.
    tokens_res = rows * s / cp / (t if sp else 1)
    tokens = rows * s / cp
    q, k, v, out = (n / t for n in spec.attention_features)
    mlp = f / t * (2 if spec.gated_mlp else 1)
    if saved == "input":
        return tokens_res * d * c
    # The matmul outputs: q, k, v, attention output, w_o, the MLP up (and gate), w_down;
    # MLA's latents too (models/mla.py: the q bottleneck, the kv latent and rotary key).
    dots = tokens * (q + k + v + out + mlp + _latents(spec)) * c + 2 * tokens_res * d * c
    if saved == "dots":
        # The w_down output is not kept: the next layer's input (kept) replaces it.
        return dots
    # The attention scores: the xla kernel keeps float32 scores and probabilities and their
    # compute-dtype copy (the full L×L); the chunked and cuDNN kernels keep only a float32
    # logsumexp per query and recompute the rest.
    full = KERNELS[spec.attention].full_scores and spec.context is None
    per_query = s * (2 * F32 + c) if full else F32
    # (Context-parallel attention keeps a float32 logsumexp of its own queries, s/cp.)
    scores = rows * spec.num_heads / t * s / cp * per_query
    if saved == "kept":
        # Without a policy the norms and their projections are recomputed from the two norm
        # inputs (models/transformer.py Block._norm_then), which take the place of the w_o
        # and w_down outputs in `dots`; the MLP activation is recomputed too. With tensor
        # parallelism XLA also keeps about one more residual-stream tensor per layer
        # (fitted on the grid: without it the tensor-parallel cases read 0.81–0.91).
        row_parallel = tokens_res * d * c if t > 1 else 0
        return dots + scores + row_parallel + _parts_kept(spec, tokens, tokens_res, t, c)
    # Plus the residual stream inputs, the two norms (float32 statistics and outputs) and
    # the MLP activation's output.
    stream = tokens_res * d * (2 * c + 2 * F32)
    act = tokens * f / t * c
    return dots + stream + act + scores + _parts_kept(spec, tokens, tokens_res, t, c)


def _latents(spec: ModelSpec) -> int:
    """MLA's per-token latents (unsharded): q's bottleneck, the kv latent and rotary key."""
    m = spec.mla
    return 0 if m is None else m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim


def _parts_kept(spec: ModelSpec, tokens: float, tokens_res: float, t: int, c: int) -> float:
    """What the family's parts keep beyond a Llama layer (their planner facts,
    models/families.py): attention parts per head, sandwich norms on the residual stream."""
    family = spec.family_entry
    heads = sum(p.kept_per_token(spec) for p in family.attention_parts)
    return (tokens * heads / t + tokens_res * family.kept_per_token(spec.d_model)) * c


def _rotated(spec: ModelSpec, rows: float, sizes: dict) -> float:
    """Bytes of one layer's q and k in float32 ([tokens, heads + kv_heads, head_dim/t]),
    as RoPE forms them; 0 without RoPE."""
    if not spec.rope:
        return 0.0
    tokens = rows * spec.seq_len / sizes.get("context", 1)
    q, k, _, _ = spec.attention_features
    return tokens * (q + k) / sizes["tensor"] * F32


def _sequence_parallel(spec: ModelSpec) -> bool:
    """Whether the residual stream's length is split over tensor (mesh.sequence_parallel)."""
    return any(name == "sequence" and "tensor" in ((axes,) if isinstance(axes, str) else axes)
               for name, axes in spec.rules if axes)


def _context_working(spec: ModelSpec, rows: float, sizes: dict, c: int) -> float:
    """What context-parallel attention adds while a layer's attention runs backward
    (models/attention/context.py, a custom VJP): the K/V it visits (the row's, all-gathered,
    or two blocks on the ring) with float32 dK/dV for as much, the device's dQ (float32),
    and one (query tile, key tile) pair's float32 scores, probabilities and their
    gradients."""
    t, cp = sizes["tensor"], sizes["context"]
    kv_row = rows * spec.seq_len * 2 * spec.num_kv_heads * spec.head_dim / t
    blocks = VARIANTS[spec.context.variant].kv_blocks  # None: the row's C blocks
    held = kv_row if blocks is None else blocks * kv_row / cp
    dq = rows * spec.seq_len / cp * spec.num_heads * spec.head_dim / t * F32
    run = spec.seq_len / cp / spec.context.chunks_per_device
    query_tile, key_tile = VARIANTS[spec.context.variant].score_tile
    tile = rows * spec.num_heads / t * min(run, query_tile) * min(run, key_tile) * F32
    return held * (c + F32) + dq + 4 * tile


def _chunked_working(spec: ModelSpec, rows: float, t: int, kernel, k: Factors) -> float:
    """The chunked kernel's float32 score buffers while a layer's attention runs: up to
    UNROLL_MAX_CHUNKS query chunks its unrolled loop forms each chunk against its key
    prefix, and XLA keeps several chunks' alive at once; longer sequences loop over
    [chunk, key block] tiles (chunked_loop.py), one tile's scores, probabilities and their
    gradients at a time."""
    heads, block = rows * spec.num_heads / t, kernel.query_chunk
    tile = kernel.loop_tile(spec.seq_len, block) if kernel.loop_tile else 0
    if tile:
        return k.loop_tiles * heads * block * tile * F32
    chunks = math.ceil(spec.seq_len / block)
    return (k.chunk_scores + k.chunk_scores_per_chunk * chunks) * (
        heads * min(block, spec.seq_len) * spec.seq_len * F32)


def routed_rows(spec: ModelSpec, tokens: float, sizes: dict[str, int]) -> float:
    """Token×choice rows one device runs through its experts in one MoE layer: the capacity
    buffers (capacity_factor·T·k, whatever routes there), k per token dropless, and with
    dropless expert parallelism the worst-case buffer every device provides (all rows of
    all expert-axis peers: expert·T·k, models/moe.py _dropless_exchanged)."""
    moe = spec.moe
    dispatch = DISPATCHES[moe.dispatch]
    per_token = min(moe.num_experts, moe.capacity_factor * moe.top_k) \
        if dispatch.padded else moe.top_k
    if dispatch.peer_buffers and sizes.get("expert", 1) > 1:
        per_token *= sizes["expert"]
    return tokens * per_token


def _moe_layer_delta(spec: ModelSpec, rows: float, sizes: dict, saved: str,
                     c: int, k: Factors) -> float:
    """What an MoE layer adds over a dense one (_layer_activations) for `rows` sequences:
    its experts' activations less the dense MLP's, plus shared experts, router and the
    dispatch buffers. Counted per routed row R (routed_rows): the expert matmuls' outputs
    (up, gate: R·2F/t), SiLU(gate)·up (R·F/t) and the rows themselves (R·D) around the
    exchange, in and out."""
    moe, t = spec.moe, sizes["tensor"]
    tokens = rows * spec.seq_len
    routed = routed_rows(spec, tokens, sizes)
    f_e, d = moe.expert_mlp_dim / t, spec.d_model
    if saved == "all" and DISPATCHES[moe.dispatch].grouped_matmuls \
            and not moe.ragged_collectives:
        # XLA:CPU expands ragged_dot into one masked dense matmul per (local) expert: while
        # a layer runs, its hidden activations exist once per expert.
        f_e *= moe.num_experts / sizes.get("expert", 1)
    dense_mlp = tokens * spec.mlp_dim / t * (2 if spec.gated_mlp else 1) * c
    if saved == "all":
        dense_mlp += tokens * spec.mlp_dim / t * c
    if saved == "input":
        return 0.0
    if saved == "dots":  # the named up/gate/down outputs
        experts = routed * (2 * f_e + d) * c
    elif saved == "kept":  # up, gate, their product, and the rows the up/gate read
        experts = k.moe_row_factor * routed * (3 * f_e + MOE_ROW_COPIES_KEPT * d) * c
    else:
        experts = k.moe_working_factor * routed * (3 * f_e + MOE_ROW_COPIES * d) * c
    shared = tokens * moe.shared_experts * f_e * (2 if saved != "all" else 3) * c
    router = tokens * moe.num_experts * 2 * F32  # logits and probabilities
    return experts + shared + router - dense_mlp


def _backward_working(spec: ModelSpec, rows: float, sizes: dict, saved: str, c: int,
                      k: Factors, per_layer, moe: bool) -> float:
    """Bytes alive while one layer runs backward for `rows` sequences, besides its weights.

    Its full set of activations exists again (recomputed under remat), with the gradients of
    those activations. Backward walks the layer's ops in reverse, freeing as it goes: a
    fitted share of each is alive at its peak. save_dots recomputes only what it did not
    save (per_layer(rows, 'dots'): what it saved); without remat nothing is recomputed and
    the gradients are the working set. Plus RoPE's float32 q and k, and the attention
    kernel's own buffers."""
    one_layer = _layer_activations(spec, rows, sizes, "all", c)
    if moe:  # the working set is that of the larger, MoE, layer
        one_layer += _moe_layer_delta(spec, rows, sizes, "all", c, k)
    if saved == "input":
        working = k.full_working * one_layer
    elif saved == "dots":
        working = k.dots_working * (one_layer - per_layer(rows, "dots"))
    else:
        working = 0.0
    working += k.grad_working * one_layer + k.rope_f32 * _rotated(spec, rows, sizes)
    if spec.context is not None:
        return working + _context_working(spec, rows, sizes, c)
    kernel = KERNELS[spec.attention]
    if kernel.query_chunk:
        working += _chunked_working(spec, rows, sizes["tensor"], kernel, k)
    return working


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """What every part of the estimate counts from: one device's share of one step."""

    cfg: Any
    spec: ModelSpec
    sizes: dict[str, int]
    k: Factors
    c: int  # bytes per activation (value_bytes)
    shards: dict[str, int]  # param_shards
    rows: int  # sequences of one (accumulation) micro-batch on this device

    @property
    def layers_here(self) -> int:
        return self.spec.num_layers // self.sizes["pipeline"]

    @property
    def moe_layers_here(self) -> int:
        moe = self.spec.moe
        return 0 if moe is None else moe.layers(self.spec.num_layers) // self.sizes["pipeline"]

    def per_layer(self, rows: float, saved: str) -> float:
        """Bytes of the device's layers for `rows` sequences, averaged over its layers."""
        spec, sizes, c = self.spec, self.sizes, self.c
        dense = _layer_activations(spec, rows, sizes, saved, c)
        if not self.moe_layers_here:
            return dense
        return dense + self.moe_layers_here / self.layers_here * _moe_layer_delta(
            spec, rows, sizes, saved, c, self.k)


def _model_state(s: _Step) -> dict[str, float]:
    """Parameters, optimizer state and gradients: float32 whatever train.precision; LoRA's
    frozen base as model.lora.base_dtype stores it."""
    params = s.shards["total_trained"] * F32 + s.shards["frozen_bytes"]
    # An objective's frozen reference copy of the parameters (without LoRA, whose base is
    # the reference): float32 like them, no gradient or optimizer state.
    objective = OBJECTIVES[s.cfg.train.objective]
    params += s.shards["total"] * F32 * (objective.holds_reference and s.spec.lora is None
                                         and objective.with_reference(s.cfg))
    # The optimizer's state mirrors the trained params (AdamW: mu and nu; under LoRA the
    # adapters only, the frozen base has none).
    opt = OPTIMIZERS[s.cfg.optimizer.name].state_per_param * s.shards["total_trained"] * F32
    # Gradients in float32 like the trained params; accumulating over micro-batches holds
    # the sum and the current micro-batch's gradients at once.
    grads = s.shards["total_trained"] * F32 * (2 if s.cfg.train.microbatches > 1 else 1)
    return {"params": params, "optimizer": opt, "gradients": grads}


def _pipeline_kept(s: _Step, saved: str) -> tuple[float, float]:
    """(activations kept, rows of one backward pass) on a pipeline stage."""
    spec, p, t = s.spec, s.sizes["pipeline"], s.sizes["tensor"]
    m, v = spec.pipeline.microbatches, spec.pipeline.repeats
    # Every loop iteration keeps its stage's chunk activations for one pipeline
    # micro-batch: (v·m + p − 1) iterations of L/(p·v) layers, bubble iterations included.
    per_micro = s.rows // m
    iterations = v * m + p - 1
    kept = iterations * (s.layers_here / v) * s.per_layer(per_micro, saved)
    # The loop's buffers: the stage buffer (p micro-batches), the last stage's output of
    # every iteration, and (circular only) the micro-batches stored between repeats.
    buffered = p * per_micro + iterations * per_micro + (s.rows if v > 1 else 0)
    # (The buffers hold the residual stream: under sequence parallelism, 1/t of it.)
    residual = spec.seq_len * spec.d_model * s.c / (t if _sequence_parallel(spec) else 1)
    kept += buffered * residual
    # Stages copy their weight stacks between layouts (the circular schedule re-lays
    # the stored stack into stage-interleaved order each step, docs/parallelism.md;
    # both schedules move the stacked weights, gradients and Adam states between
    # [L, ...] and per-stage layouts): float32 copies of this device's layer weights.
    kept += s.k.pipeline_weight_copies * s.shards["stack"] * F32
    return kept, per_micro


def _kept(s: _Step, saved: str) -> tuple[float, float]:
    """(activations the layers keep for the backward pass, rows of one backward pass)."""
    if s.sizes["pipeline"] > 1:
        return _pipeline_kept(s, saved)
    return s.layers_here * s.per_layer(s.rows, saved), s.rows


def _layer_backward(s: _Step, saved: str, working_rows: float) -> float:
    """One layer's backward pass: its working set, and its gathered weights with their
    gradients."""
    working = _backward_working(s.spec, working_rows, s.sizes, saved, s.c, s.k, s.per_layer,
                                moe=bool(s.moe_layers_here))
    layer_weights = (s.shards["layer_gathered"] * s.k.layer_weights * s.c
                     + s.shards["layer_gathered_trained"] * s.k.layer_weight_grads * F32)
    return working + layer_weights


def _head_and_loss(s: _Step) -> float:
    """The fused head and loss (models/head_loss.py): float32 logits, their exponent and
    the compute-dtype logit gradient for a chunk, the stacked input gradient, and the
    gathered head with its float32 gradient."""
    spec, sizes, k, c = s.spec, s.sizes, s.k, s.c
    cp = sizes.get("context", 1)
    global_rows = s.cfg.train.global_batch // s.cfg.train.microbatches
    # Under context parallelism the chunks are cp× longer and each device holds 1/cp.
    chunk = OBJECTIVES[s.cfg.train.objective].logits_chunk(spec.seq_len, global_rows, cp)
    chunk_tokens = chunk * global_rows / batch_shards(sizes) / cp
    vocab_local = spec.vocab_size / sizes["tensor"]
    logits = chunk_tokens * vocab_local * (k.logit_f32 * F32 + c) + \
        k.head_stream * s.rows * spec.seq_len * spec.d_model * c / cp
    # The output head gathered for the loss, with its float32 gradient; the embedding table
    # is gathered for the lookup in the forward pass only (its gradient is formed in its
    # shard: models/embedding.py).
    head = s.shards["head_gathered"] * c * k.head_copies \
        + s.shards["head_gathered_trained"] * F32
    return logits + head


def estimate(cfg, sizes: dict[str, int], backend: str = "accelerator",
             platform: str | None = None, factors: Factors | None = None
             ) -> dict[str, float]:
    """Per-device bytes by part, and 'total'. sizes: mesh axis sizes from config.validate.

    backend='cpu' predicts XLA's CPU backend instead of a GPU/TPU: it has no bf16 matmuls
    and runs bfloat16 activations through float32 copies, so they are counted at 4 bytes.
    platform ('cpu', 'gpu', 'tpu'; default: cpu for backend='cpu', else gpu) is what
    model.attention='auto' resolves for.
    """
    platform = platform or ("cpu" if backend == "cpu" else "gpu")
    # The batch layout's document masks take part in the kernel 'auto' picks.
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes["pipeline"], platform=platform,
                                 context=sizes.get("context", 1),
                                 segments=document_masks(cfg))
    s = _Step(cfg, spec, sizes, factors or factors_for(platform), value_bytes(spec, backend),
              param_shards(spec, sizes),
              cfg.train.global_batch // cfg.train.microbatches // batch_shards(sizes))
    state = _model_state(s)
    # What stays on the device per layer, from the remat registry (the finer policies are
    # modelled by their nearest coarse one: save_dots_except_mlp as save_dots,
    # save_attention_out and offload_dots as full remat; --compile gives XLA's figure).
    saved = REMATS[spec.remat].saves
    kept, working_rows = _kept(s, saved)
    # The two phases of the step that peak at different times: the head and loss (between
    # the layers' forward and backward passes), and one layer's backward pass.
    phases = {"layer_backward": _layer_backward(s, saved, working_rows),
              "head_and_loss": _head_and_loss(s)}
    # XLA overlaps them in part (the head's gradient, formed in the first, is reduced with
    # the others at the end): the larger, and a fitted share of the smaller.
    peak = max(phases.values()) + s.k.phase_overlap * min(phases.values())
    grads = state["gradients"]
    temporaries = s.k.temp_margin * (grads + kept + peak) + s.k.peak_margin * peak
    parts = {**state, "activations": kept, **phases, "temporaries": temporaries}
    parts["total"] = state["params"] + state["optimizer"] + grads + kept + peak + temporaries
    return parts


PHASES = ("layer_backward", "head_and_loss")  # estimate's parts that peak at different times
