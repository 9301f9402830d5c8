"""Decoder-only Transformer: any family of models/families.py, layers stacked and scanned
(models/stack.py walks them)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.mesh import active_rules, constrain
from jaxtrain.models.attention import Attention, resolve_attention, resolve_variant
from jaxtrain.models.attention import cache as decode_cache
from jaxtrain.models.embedding import embed
from jaxtrain.models.families import (
    FAMILIES,
    LAYER_KINDS,
    UNIFORM,
    Family,
    LayerKind,
    layer_pattern,
    linear_layers,
    pattern_window,
)
from jaxtrain.models.head_loss import soft_cap
from jaxtrain.models.layers import Norm, param
from jaxtrain.models.linear_attention.layer import GatedDeltaNet, LinearSpec
from jaxtrain.models.lora import LoraSpec
from jaxtrain.models.mla import MLA, MlaSpec
from jaxtrain.models.mla import resolve_kernel as mla_kernel
from jaxtrain.models.mlp import Mlp
from jaxtrain.models.moe import STAT_NAMES, MoeMlp, MoeSpec, routing_losses
from jaxtrain.models.mtp import MtpDepth, MtpSpec, mtp_loss
from jaxtrain.models.remat import REMATS
from jaxtrain.models.rope import RopeScaling
from jaxtrain.models.router import EXPERT_LOAD, ROUTERS, DeepSeekMoe, RouterSpec
from jaxtrain.models.stack import Groups, stack_of, stacked, walk, walk_mixed
from jaxtrain.parallel.context import ContextSpec
from jaxtrain.parallel.pipeline import PipelineSpec, pipeline
from jaxtrain.precision import PRECISIONS


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything the model needs, resolved once from the config."""

    family: str
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab_size: int
    seq_len: int
    attention: str = "xla"
    sliding_window: int = 0  # 0: full causal attention; W: each query sees its last W keys
    # Each layer's kind (models/families.py LAYER_KINDS); (): every layer UNIFORM
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0  # the local-rope kinds' theta, unscaled; 0: rope_theta's
    remat: str = "none"
    rope_theta: float = 10000.0
    attention_scale_dim: int = 0  # q·k times attention_scale_dim**-0.5; 0: head_dim's
    attn_softcap: float = 0.0  # attention-logit soft-cap c (c·tanh(s/c)); 0: none
    final_softcap: float = 0.0  # final-logit soft-cap (models/head_loss.py soft_cap); 0: none
    rope_scaling: RopeScaling | None = None  # None: plain RoPE (models/rope.py)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # model.tie_embeddings (or the family ties: tied_embeddings)
    init_std: float = 0.02
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    rules: tuple = ()
    pipeline: PipelineSpec | None = None  # None: no pipeline axis
    fp8: bool = False  # the blocks' weight matmuls take fp8 operands (models/fp8.py)
    moe: MoeSpec | None = None  # mixture-of-experts layers (models/moe.py); None: dense
    context: ContextSpec | None = None  # the sequence split over `context`; None: whole
    lora: LoraSpec | None = None  # low-rank adapters on the targeted weights (models/lora.py)
    # Multi-head latent attention in every layer (models/mla.py); None: the GQA layer
    mla: MlaSpec | None = None
    # The MoE layers' router (models/router.py ROUTERS) when not Mixtral's softmax (None)
    router: RouterSpec | None = None
    mtp: MtpSpec | None = None  # multi-token prediction depths (models/mtp.py); None: none
    rope_fraction: float = 1.0  # RoPE over each head's first fraction of features
    # The linear_attention layers' shape (models/linear_attention/); None: no such layer
    linear: LinearSpec | None = None

    @classmethod
    def from_config(cls, cfg, pipeline_stages: int = 1, platform: str = "cpu",
                    context: int = 1, segments: bool = False) -> ModelSpec:
        """pipeline_stages, context: the resolved sizes of the mesh's pipeline and context
        axes; platform: the devices' platform, which model.attention='auto' picks for;
        segments: the batch layout gives the kernels document masks (data/layouts.py
        `segments`, which this layer below data/ is handed)."""
        m = cfg.model
        pipeline = None
        if pipeline_stages > 1:
            pipeline = PipelineSpec(pipeline_stages, cfg.pipeline.repeats,
                                    cfg.pipeline.microbatches)
        context_spec = None
        if context > 1:
            context_spec = ContextSpec(
                context, resolve_variant(m.context_attention, m.num_heads,
                                         m.num_kv_heads or m.num_heads),
                cfg.mesh.context_load_balance)
        precision = PRECISIONS[cfg.train.precision]
        mla = MlaSpec.from_config(m.mla)
        if mla is None:
            attention = resolve_attention(m.attention, cfg.train.precision, platform,
                                          m.seq_len, pattern_window(m), segments,
                                          m.attn_logit_softcap, FAMILIES[m.family].kernel_parts)
        else:  # the kernels that take MLA's v head dim (config.py refuses a config with none)
            attention = mla_kernel(m.attention, cfg.train.precision, platform, m.seq_len,
                                   pattern_window(m), segments)
        router = RouterSpec.from_config(m.moe) if m.moe.num_experts else None
        return cls(
            family=m.family, d_model=m.d_model, num_layers=m.num_layers,
            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads or m.num_heads,
            head_dim=m.head_dim or m.d_model // m.num_heads, mlp_dim=m.mlp_dim,
            vocab_size=m.vocab_size, seq_len=m.seq_len,
            attention=attention,
            sliding_window=m.sliding_window,
            layer_types=layer_pattern(m.layer_types, m.num_layers),
            rope_local_theta=m.rope_local_theta,
            remat=m.remat, rope_theta=m.rope_theta, rope_scaling=_rope_scaling(m),
            attention_scale_dim=m.attention_scale_dim, attn_softcap=m.attn_logit_softcap,
            final_softcap=m.final_logit_softcap,
            norm_eps=m.norm_eps, tie_embeddings=bool(m.tie_embeddings),
            init_std=m.init_std, compute_dtype=precision.compute_dtype,
            rules=active_rules(tuple(tuple(r) for r in cfg.mesh.rules),
                               cfg.mesh.sequence_parallel, context_spec is not None),
            pipeline=pipeline, fp8=precision.fp8_matmuls, moe=MoeSpec.from_config(m, platform),
            context=context_spec, lora=LoraSpec.from_config(m), mla=mla,
            router=None if router is None or router.name == "softmax" else router,
            mtp=MtpSpec.from_config(m.mtp), rope_fraction=m.partial_rotary_factor,
            linear=LinearSpec.from_config(m) if linear_layers(m) else None)

    @property
    def family_entry(self) -> Family:
        return FAMILIES[self.family]

    # What the model code reads: the family's fields, never its name.
    use_bias = property(lambda self: self.family_entry.bias)
    rope = property(lambda self: self.family_entry.rope)
    tied_embeddings = property(lambda self: self.family_entry.tied_embeddings
                               or self.tie_embeddings)
    gated_mlp = property(lambda self: self.family_entry.gated_mlp)
    rms_norm = property(lambda self: self.family_entry.norm == "rms")
    attention_parts = property(lambda self: self.family_entry.attention_parts)
    norm_offset = property(lambda self: self.family_entry.norm_offset)

    @property
    def attention_features(self) -> tuple[int, int, int, int]:
        """Planner fact: per token and layer, the (q, k, v, output) features the attention
        kernel takes and gives: GQA's heads·head_dim, kv_heads·head_dim twice, heads·head_dim;
        MLA's expanded heads·(nope + rope) for q and k, heads·v_head_dim for v and output."""
        if self.mla is None:
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return q, kv, kv, q
        qk, v = (self.num_heads * d for d in (self.mla.qk_head_dim, self.mla.v_head_dim))
        return qk, qk, v, v

    def layer_kind(self, name: str | None) -> LayerKind:
        """A layer kind's entry: the walker hands each layer its kind's name (None: the
        model has no pattern, every layer UNIFORM)."""
        return UNIFORM if name is None else LAYER_KINDS[name]


def _rope_scaling(m) -> RopeScaling | None:
    return None if m.rope_scaling.type == "none" else RopeScaling.from_config(m.rope_scaling)


class Block(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        norm = dict(rms=spec.rms_norm, eps=spec.norm_eps, dtype=spec.param_dtype, rngs=rngs,
                    offset=spec.norm_offset)
        self.spec = spec
        self.attn_norm = Norm(spec.d_model, **norm)
        self.attn = (Attention(spec, rngs=rngs) if spec.mla is None
                     else MLA.module(spec, spec.mla, rngs=rngs))
        self.mlp_norm = Norm(spec.d_model, **norm)
        self.mlp = self._make_mlp(spec, rngs)
        if spec.family_entry.sandwich:  # ones or zeros: no random draws
            self.post_attn_norm = Norm(spec.d_model, **norm)
            self.post_mlp_norm = Norm(spec.d_model, **norm)

    def _post(self, name: str, y_BLD):
        """A sub-layer's output, normed again under sandwich norms (else as it is)."""
        return getattr(self, name)(y_BLD) if self.spec.family_entry.sandwich else y_BLD

    def _make_mlp(self, spec: ModelSpec, rngs: nnx.Rngs):
        return Mlp(spec, rngs=rngs)

    def __call__(self, x_BLD: jax.Array, segments_BL=None, positions_BL=None,
                 kind: str | None = None):
        """(x_BLD, aux): aux is the layer's per-row routing stats in an MoE block, {} in a
        dense one (models/stack.py sums them over the layers). segments_BL, positions_BL:
        packed documents' ids and restarted positions (models/attention/kernels.py); None:
        one document per row. kind: the layer's kind (model.layer_types; None: uniform)."""
        q_BLHK, k_BLGK, v_BLGK, gate = self._norm_then(self._project(positions_BL, kind))(
            x_BLD)
        extra = {} if gate is None else {"gate_BLHK": gate}  # the output gate (a part)
        x_BLD = x_BLD + self._post("post_attn_norm", self.attn.attend(
            q_BLHK, k_BLGK, v_BLGK, segments_BL, kind, **extra))
        return self._mlp_residual(x_BLD)

    def _project(self, positions_BL, kind):
        """x -> (q, k, v, the output gate's logits or None) of the normed x."""
        gate = getattr(self.attn, "gate", lambda x: None)

        def project(x_BLD):
            normed_BLD = self.attn_norm(x_BLD)
            return (*self.attn.qkv(normed_BLD, positions_BL, kind), gate(normed_BLD))

        return project

    def _norm_then(self, norm_and_project):
        """Without a remat policy, each norm and the projections reading it are recomputed
        in the backward pass from the norm's input: the projections' weight gradients then
        do not keep the norm's output, nor the norm its own statistics (one B·L·D tensor
        per norm instead of two; configs/bench_cpu.py: −3% step time, −10% temporaries).
        XLA drops the recomputed matmuls, which the backward pass does not use. Under a
        remat policy, the policy decides what is kept."""
        if REMATS[self.spec.remat].policy is not None:
            return norm_and_project
        return jax.checkpoint(norm_and_project, policy=jax.checkpoint_policies.nothing_saveable)

    def _mlp_residual(self, x_BLD, drop: bool = True):
        rules = self.spec.rules
        x_BLD = constrain(x_BLD, ("batch", "sequence", "embed"), rules)
        y_BLD, aux = self._feed_forward(x_BLD, drop)
        y_BLD = self._post("post_mlp_norm", y_BLD)
        return constrain(x_BLD + y_BLD, ("batch", "sequence", "embed"), rules), aux

    def _feed_forward(self, x_BLD, drop: bool):
        """(the normed feed-forward's output, aux); drop: whether an MoE layer may drop
        tokens over an expert's capacity (not while decoding)."""
        del drop
        h_BLF, gate_BLF = self._norm_then(lambda x: self.mlp.up(self.mlp_norm(x)))(x_BLD)
        return self.mlp.down(h_BLF, gate_BLF), {}

    def decode(self, x_BTD: jax.Array, cache: tuple, start: jax.Array,
               kind: str | None = None, valid=None):
        """(x_BTD, the new tokens' cache entries, which Transformer.decode writes); no
        expert drops a token while generating. valid: the real tokens of a padded prefill
        (an attention layer's mask hides the padding's keys until decoding overwrites
        them)."""
        del valid
        y_BTD, new = self.attn.decode(self.attn_norm(x_BTD), cache, start, kind)
        return self._mlp_residual(x_BTD + self._post("post_attn_norm", y_BTD),
                                  drop=False)[0], new


class LinearBlock(Block):
    """A Gated DeltaNet layer (model.layer_types linear_attention) and its feed-forward."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        norm = dict(rms=spec.rms_norm, eps=spec.norm_eps, dtype=spec.param_dtype, rngs=rngs,
                    offset=spec.norm_offset)
        self.spec = spec
        self.attn_norm = Norm(spec.d_model, **norm)
        self.attn = GatedDeltaNet(spec, rngs=rngs)
        self.mlp_norm = Norm(spec.d_model, **norm)
        self.mlp = self._make_mlp(spec, rngs)

    def __call__(self, x_BLD, segments_BL=None, positions_BL=None, kind=None):
        """(x_BLD, {}): config.py refuses document masks with linear layers."""
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD))
        return self._mlp_residual(x_BLD)

    def decode(self, x_BTD, cache: tuple, start, kind=None, valid=None):
        y_BTD, cache = self.attn.decode(self.attn_norm(x_BTD), cache, start, valid)
        return self._mlp_residual(x_BTD + y_BTD, drop=False)[0], cache


class MoeBlock(Block):
    """A block whose feed-forward is a mixture of experts: its aux is the layer's per-row
    routing stats (models/moe.py STAT_NAMES)."""

    def _make_mlp(self, spec: ModelSpec, rngs: nnx.Rngs):
        if spec.router is None:  # Mixtral's softmax router
            return MoeMlp(spec, rngs=rngs)
        return DeepSeekMoe(spec, spec.router, rngs=rngs)

    def _feed_forward(self, x_BLD, drop: bool):
        return self.mlp(self.mlp_norm(x_BLD), drop)


class Transformer(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        self.spec = spec
        d, v, dt = spec.d_model, spec.vocab_size, spec.param_dtype
        self.tok_embed = param(rngs, (v, d), ("vocab", "embed"), spec.init_std, dt)
        if not spec.rope:
            self.pos_embed = param(rngs, (spec.seq_len, d), (None, "embed"), spec.init_std, dt)
        keys = jax.random.split(rngs.params(), spec.num_layers)
        # Dense layers under `blocks`, MoE layers (every n-th) under `moe_blocks`.
        moe_layer = Groups.of(spec).moe_layers()
        if spec.linear is not None:  # linear layers stacked apart (config.py: no MoE)
            linear = np.asarray([LAYER_KINDS[k].linear for k in spec.layer_types])
            self.blocks = stacked(Block, spec, keys[np.flatnonzero(~linear)])
            self.linear_blocks = stacked(LinearBlock, spec, keys[np.flatnonzero(linear)])
        elif not moe_layer.all():
            self.blocks = stacked(Block, spec, keys[np.flatnonzero(~moe_layer)])
        if moe_layer.any():
            self.moe_blocks = stacked(MoeBlock, spec, keys[np.flatnonzero(moe_layer)])
        self.final_norm = Norm(d, rms=spec.rms_norm, eps=spec.norm_eps, dtype=dt, rngs=rngs,
                               offset=spec.norm_offset)
        if not spec.tied_embeddings:
            self.lm_head = param(rngs, (d, v), ("embed", "vocab"), spec.init_std, dt)
        # Multi-token prediction: each depth a dense block of the model's own kind (after
        # every other weight, so a model without MTP draws the same numbers).
        for k in range(1, (spec.mtp.depths if spec.mtp else 0) + 1):
            setattr(self, f"mtp_{k}", MtpDepth(spec, Block(spec, rngs=rngs), rngs=rngs))

    def _embed(self, tokens_BL: jax.Array, start=0, positions_BL=None) -> jax.Array:
        spec, dt = self.spec, self.spec.compute_dtype
        # Gathered like any weight, its gradient formed in the table's own sharding.
        x_BLD = embed(self.tok_embed[...], tokens_BL, dt, spec.rules)
        if spec.family_entry.embed_scale:  # sqrt(d) in the table's dtype, as HF scales it
            x_BLD = x_BLD * jnp.asarray(spec.d_model ** 0.5, self.tok_embed[...].dtype).astype(dt)
        if not spec.rope:
            if positions_BL is None:
                positions_LD = jax.lax.dynamic_slice_in_dim(self.pos_embed[...], start,
                                                            tokens_BL.shape[1])
            else:  # packed documents: each row's own (restarted) positions
                positions_LD = jnp.take(self.pos_embed[...], positions_BL, axis=0)
            x_BLD = x_BLD + positions_LD.astype(dt)
        return constrain(x_BLD, ("batch", "sequence", "embed"), spec.rules)

    def features(self, tokens_BL: jax.Array, segments_BL=None, positions_BL=None
                 ) -> jax.Array:
        """The final-normed hidden states that the output head reads."""
        return self.features_and_aux(tokens_BL, segments_BL, positions_BL)[0]

    def features_and_aux(self, tokens_BL: jax.Array, segments_BL=None, positions_BL=None):
        """(features, the weighted auxiliary losses of the MoE routers and the MTP depths
        or None, their metrics: {} for a dense model without MTP). segments_BL and
        positions_BL: packed documents (int32 [B, L]: each position's document, 0 for
        padding, and its position within it); None: one document per row."""
        spec = self.spec
        x_BLD = self._embed(tokens_BL, positions_BL=positions_BL)
        # Positions alone (no documents) come with a context-parallel layout's reordering.
        documents = None if segments_BL is None and positions_BL is None \
            else (segments_BL, positions_BL)
        x_BLD, stats = self._layers(x_BLD, documents)
        penalty, metrics = None, {}
        if spec.mtp is not None:  # its loss rides with the routers' as the penalty
            penalty, metrics = mtp_loss(
                [getattr(self, f"mtp_{k}") for k in range(1, spec.mtp.depths + 1)], spec.mtp,
                x_BLD, tokens_BL, self._embed,
                lambda n_BLD: soft_cap(n_BLD @ self.head(), spec.final_softcap))
        if spec.moe is not None:
            routing, routing_metrics = routing_losses(stats, spec.moe, tokens_BL.size)
            penalty = routing if penalty is None else penalty + routing
            metrics = {**metrics, **routing_metrics}
            if spec.router is not None and ROUTERS[spec.router.name].bias:
                # The step's expert loads [MoE layers, E], for the correction bias's update
                # (train/step.py takes it out of the logged metrics).
                metrics[EXPERT_LOAD] = stats["load"].sum(0)
        return (constrain(self.final_norm(x_BLD), ("batch", "length", "embed"), spec.rules),
                penalty, metrics)

    def _remat(self, f):
        policy = REMATS[self.spec.remat].policy
        return f if policy is None else jax.checkpoint(f, policy=policy, prevent_cse=False)

    def _stacks(self) -> tuple[dict, dict]:
        """({kind: graphdef}, {kind: stacked state, by group}) of the layer stacks; a dense
        prefix's state (model.moe.first_dense_layers) under "prefix"."""
        groups, defs, states = Groups.of(self.spec), {}, {}
        for kind, blocks in (("dense", "blocks"), ("moe", "moe_blocks")):
            if hasattr(self, blocks):
                defs[kind], state = nnx.split(getattr(self, blocks))
                states[kind] = groups.by_group(state) if kind == "dense" else state
        if groups.prefix:  # every dense layer is in the prefix (config.py checks it)
            states["prefix"] = states.pop("dense")
        return defs, states

    def _layers(self, x_BLD: jax.Array, documents):
        """(x_BLD after every layer, routing stats [B, MoE layers, ...] or {}). documents:
        (segments_BL, positions_BL) of packed rows, or None; under the pipeline they travel
        with their micro-batch through the stages, as the stats do in the carry."""
        spec, groups = self.spec, Groups.of(self.spec)
        if spec.linear is not None:
            return self._mixed_layers(x_BLD, documents), {}
        defs, xs = self._stacks()
        stats = {}
        if groups.moe:
            xs["index"] = jnp.arange(groups.count)
            stats = self._zero_stats(x_BLD.shape[0], groups.count)

        def run(chunk, carry, documents=None):
            def layer(kind, x_BLD, state, layer_kind, view=None):
                segments_BL, positions_BL = documents or (None, None)
                block = self._remat(lambda x, state: nnx.merge(
                    defs[kind], state if view is None else view(state))(
                    x, segments_BL, positions_BL, layer_kind))
                return (*block(x_BLD, state), None)

            return walk(groups, layer, carry, chunk)[0]

        if spec.pipeline is None:
            return run(xs, (x_BLD, stats), documents)
        return pipeline(run, xs, (x_BLD, stats), spec.pipeline, spec.rules, documents)

    def _mixed_stacks(self) -> tuple[dict, dict]:
        """({stack: graphdef}, {stack: stacked state}) of a model with linear layers."""
        split = {s: nnx.split(getattr(self, s)) for s in ("blocks", "linear_blocks")}
        return {s: d for s, (d, _) in split.items()}, {s: st for s, (_, st) in split.items()}

    def _mixed_layers(self, x_BLD, documents):
        """The layers of a model with linear-attention layers (models/stack.py walk_mixed);
        documents: positions only (config.py refuses document masks with linear layers)."""
        defs, xs = self._mixed_stacks()
        positions_BL = None if documents is None else documents[1]

        def layer(kind, x_BLD, state):
            block = self._remat(lambda x, state: nnx.merge(defs[stack_of(kind)], state)(
                x, None, positions_BL, kind)[0])
            return block(x_BLD, state), None

        return walk_mixed(self.spec.layer_types, layer, x_BLD, xs)[0]

    def _zero_stats(self, batch: int, layers: int) -> dict:
        e = self.spec.moe.num_experts
        shapes = {k: (batch, layers, e) if k in ("load", "prob") else (batch, layers)
                  for k in STAT_NAMES}
        return {k: constrain(jnp.zeros(shape, jnp.float32),
                             ("batch",) + (None,) * (len(shape) - 1), self.spec.rules)
                for k, shape in shapes.items()}

    def head(self) -> jax.Array:
        """The output projection [D, V]: the embedding table transposed when tied."""
        head, vocab_major = self.head_as_stored()
        return head.T if vocab_major else head

    def head_as_stored(self) -> tuple[jax.Array, bool]:
        """(the output projection in its stored layout, whether that is [V, D]): the
        embedding table when tied, else lm_head [D, V]."""
        if self.spec.tied_embeddings:
            return self.tok_embed[...].astype(self.spec.compute_dtype), True
        return self.lm_head[...].astype(self.spec.compute_dtype), False

    def __call__(self, tokens_BL: jax.Array, segments_BL=None, positions_BL=None
                 ) -> jax.Array:
        logits_BLV = soft_cap(self.features(tokens_BL, segments_BL, positions_BL) @ self.head(),
                              self.spec.final_softcap)
        return constrain(logits_BLV, ("batch", "length", "vocab"), self.spec.rules)

    def init_cache(self, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
        """Every layer's decoding cache for `length` positions: keys and values
        [layers, B, G, M, K] each, or MLA's latents [layers, B, M, kv_lora_rank] and rotary
        keys [layers, B, M, rope] (models/mla.py); their axes: models/attention/cache.py."""
        spec = self.spec
        if spec.linear is not None:
            return self._mixed_cache(batch, length)
        if spec.mla is not None:
            return tuple(constrain(jnp.zeros((spec.num_layers, batch, length, dim),
                                             spec.compute_dtype),
                                   decode_cache.LATENT_AXES, spec.rules)
                         for dim in (spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim))
        shape = (spec.num_layers, batch, spec.num_kv_heads, length, spec.head_dim)
        zeros = jnp.zeros(shape, spec.compute_dtype)
        axes = decode_cache.KV_AXES
        return constrain(zeros, axes, spec.rules), constrain(zeros, axes, spec.rules)

    def _mixed_cache(self, batch: int, length: int) -> dict:
        """{blocks: (keys, values) [attention layers, B, G, M, K], linear_blocks: (conv
        inputs q, k, v [linear layers, B, W−1, heads, dim], state [linear layers, B, H, K,
        V] float32)}: the linear layers' part is the same whatever `length`."""
        spec, linear = self.spec, sum(LAYER_KINDS[k].linear for k in self.spec.layer_types)
        shape = (spec.num_layers - linear, batch, spec.num_kv_heads, length, spec.head_dim)
        kv = tuple(constrain(jnp.zeros(shape, spec.compute_dtype), decode_cache.KV_AXES,
                             spec.rules)
                   for _ in range(2))
        ls = spec.linear
        conv_axes = ("layers", "batch", None, "kv_heads", "kv")
        states = (jnp.zeros((linear, batch, ls.conv - 1, ls.key_heads, ls.key_dim),
                            spec.compute_dtype),) * 2 + (
            jnp.zeros((linear, batch, ls.conv - 1, ls.value_heads, ls.value_dim),
                      spec.compute_dtype),
            jnp.zeros((linear, batch, ls.value_heads, ls.key_dim, ls.value_dim), jnp.float32))
        axes_each = (conv_axes, conv_axes, ("layers", "batch", None, "heads", "kv"),
                     ("layers", "batch", "heads", None, None))
        return {"blocks": kv, "linear_blocks": tuple(
            constrain(z, a, spec.rules) for z, a in zip(states, axes_each))}

    def decode(self, tokens_BT: jax.Array, cache: tuple, start: jax.Array, valid=None,
               keys: int | None = None):
        """Logits of T new tokens at positions [start, start+T), reading and extending the
        kv cache of the earlier ones (prefill: start 0, T = prompt; then T = 1 per token).
        start: a scalar shared by the batch, or [B], each row's own (the engine's slots,
        jaxtrain/engine/). The cache stays [layers, ...]; the walker reads it by group.
        valid: the real tokens of a padded prefill (None: all); the linear layers' state
        takes only those. keys: how many of the cache's positions the attention layers read
        (None: all), when every row's start + T is within them: a step's cost then follows
        the rows' lengths, not the cache's (the engine's key buckets)."""
        if jnp.ndim(start) == 0:
            x_BTD = self._embed(tokens_BT, start)
        else:  # each row's own positions (the position table's rows, where there is one)
            x_BTD = self._embed(tokens_BT, positions_BL=decode_cache.positions(
                start, tokens_BT.shape[1]))
        if self.spec.linear is not None:
            x_BTD, new = self._mixed_decode(x_BTD, cache, start, valid, keys)
        else:
            x_BTD, new = self._grouped_decode(x_BTD, cache, start, keys)
        logits_BTV = soft_cap(self.final_norm(x_BTD) @ self.head(), self.spec.final_softcap)
        return constrain(logits_BTV, ("batch", "length", "vocab"), self.spec.rules), new

    def _grouped_decode(self, x_BTD, cache: tuple, start, keys):
        """decode's layers by group (models/stack.py walk), each reading its cache:
        (x_BTD, the new cache). The layers' new entries are written once after the stack,
        in place (models/attention/cache.py: not a new cache out of the scan every step)."""
        groups = Groups.of(self.spec)
        defs, states = self._stacks()

        def layer(kind, x_BTD, state_and_cache, layer_kind, view=None):
            state, layer_cache = state_and_cache if view is None else view(state_and_cache)
            x_BTD, new = nnx.merge(defs[kind], state).decode(
                x_BTD, decode_cache.first(layer_cache, keys), start, layer_kind)
            return x_BTD, {}, new

        xs = {kind: (states[kind], c) for kind, c in groups.split(cache).items()}
        (x_BTD, _), new = walk(groups, layer, (x_BTD, {}), xs)
        return x_BTD, tuple(decode_cache.write_layers(c, n, start)
                            for c, n in zip(cache, groups.join(new)))

    def _mixed_decode(self, x_BTD, cache: dict, start, valid, keys):
        """decode's layers with linear-attention layers: (x_BTD, the new cache). A linear
        layer returns its whole new state; the attention layers their new entries, written
        after the stack (models/attention/cache.py)."""
        defs, states = self._mixed_stacks()

        def layer(kind, x_BTD, state_and_cache):
            state, layer_cache = state_and_cache
            if stack_of(kind) == "blocks":  # an attention layer's (a linear one's: its state)
                layer_cache = decode_cache.first(layer_cache, keys)
            return nnx.merge(defs[stack_of(kind)], state).decode(x_BTD, layer_cache, start,
                                                                 kind, valid)

        xs = {s: (states[s], cache[s]) for s in states}
        x_BTD, new = walk_mixed(self.spec.layer_types, layer, x_BTD, xs)
        new["blocks"] = tuple(decode_cache.write_layers(c, n, start)
                              for c, n in zip(cache["blocks"], new["blocks"]))
        return x_BTD, new
