"""Decoder-only Transformer: any family of models/families.py, layers stacked and scanned."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.mesh import active_rules, constrain
from jaxtrain.models.attention import Attention, resolve_attention
from jaxtrain.models.families import FAMILIES, Family
from jaxtrain.models.layers import Norm, param
from jaxtrain.models.mlp import Mlp
from jaxtrain.models.remat import REMATS
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
    remat: str = "none"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    rules: tuple = ()
    pipeline: PipelineSpec | None = None  # None: no pipeline axis
    fp8: bool = False  # the blocks' weight matmuls take fp8 operands (models/fp8.py)

    @classmethod
    def from_config(cls, cfg, pipeline_stages: int = 1, platform: str = "cpu") -> "ModelSpec":
        """pipeline_stages: the resolved size of the mesh's pipeline axis; platform: the
        devices' platform, which model.attention='auto' picks for."""
        m = cfg.model
        pipeline = None
        if pipeline_stages > 1:
            pipeline = PipelineSpec(pipeline_stages, cfg.pipeline.repeats,
                                    cfg.pipeline.microbatches)
        precision = PRECISIONS[cfg.train.precision]
        return cls(
            family=m.family, d_model=m.d_model, num_layers=m.num_layers,
            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads or m.num_heads,
            head_dim=m.head_dim or m.d_model // m.num_heads, mlp_dim=m.mlp_dim,
            vocab_size=m.vocab_size, seq_len=m.seq_len,
            attention=resolve_attention(m.attention, cfg.train.precision, platform, m.seq_len,
                                        m.sliding_window, cfg.data.packing == "documents"),
            sliding_window=m.sliding_window,
            remat=m.remat, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
            init_std=m.init_std, compute_dtype=precision.compute_dtype,
            rules=active_rules(tuple(tuple(r) for r in cfg.mesh.rules),
                               cfg.mesh.sequence_parallel),
            pipeline=pipeline, fp8=precision.fp8_matmuls)

    @property
    def family_entry(self) -> Family:
        return FAMILIES[self.family]

    # What the model code reads: the family's fields, never its name.
    use_bias = property(lambda self: self.family_entry.bias)
    rope = property(lambda self: self.family_entry.rope)
    tied_embeddings = property(lambda self: self.family_entry.tied_embeddings)
    gated_mlp = property(lambda self: self.family_entry.gated_mlp)
    rms_norm = property(lambda self: self.family_entry.norm == "rms")


class Block(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        norm = dict(rms=spec.rms_norm, eps=spec.norm_eps, dtype=spec.param_dtype, rngs=rngs)
        self.spec = spec
        self.attn_norm = Norm(spec.d_model, **norm)
        self.attn = Attention(spec, rngs=rngs)
        self.mlp_norm = Norm(spec.d_model, **norm)
        self.mlp = Mlp(spec, rngs=rngs)

    def __call__(self, x_BLD: jax.Array, segments_BL=None, positions_BL=None) -> jax.Array:
        """segments_BL, positions_BL: packed documents' ids and restarted positions
        (models/attention.py); None: one document per row."""
        q_BLHK, k_BLGK, v_BLGK = self._norm_then(
            lambda x: self.attn.qkv(self.attn_norm(x), positions_BL))(x_BLD)
        x_BLD = x_BLD + self.attn.attend(q_BLHK, k_BLGK, v_BLGK, segments_BL)
        return self._mlp_residual(x_BLD)

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

    def _mlp_residual(self, x_BLD):
        x_BLD = constrain(x_BLD, ("batch", "sequence", "embed"), self.spec.rules)
        h_BLF, gate_BLF = self._norm_then(lambda x: self.mlp.up(self.mlp_norm(x)))(x_BLD)
        x_BLD = x_BLD + self.mlp.down(h_BLF, gate_BLF)
        return constrain(x_BLD, ("batch", "sequence", "embed"), self.spec.rules)

    def decode(self, x_BTD: jax.Array, cache: tuple, start: jax.Array):
        y_BTD, cache = self.attn.decode(self.attn_norm(x_BTD), cache, start)
        return self._mlp_residual(x_BTD + y_BTD), cache


class Transformer(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        self.spec = spec
        d, v, dt = spec.d_model, spec.vocab_size, spec.param_dtype
        self.tok_embed = param(rngs, (v, d), ("vocab", "embed"), spec.init_std, dt)
        if not spec.rope:
            self.pos_embed = param(rngs, (spec.seq_len, d), (None, "embed"), spec.init_std, dt)
        keys = jax.random.split(rngs.params(), spec.num_layers)
        self.blocks = nnx.vmap(lambda key: Block(spec, rngs=nnx.Rngs(key)))(keys)
        for _, var in nnx.iter_graph(self.blocks):
            if isinstance(var, nnx.Variable):
                var.set_metadata("axes", ("layers",) + var.get_metadata()["axes"])
        self.final_norm = Norm(d, rms=spec.rms_norm, eps=spec.norm_eps, dtype=dt, rngs=rngs)
        if not spec.tied_embeddings:
            self.lm_head = param(rngs, (d, v), ("embed", "vocab"), spec.init_std, dt)

    def _embed(self, tokens_BL: jax.Array, start=0, positions_BL=None) -> jax.Array:
        spec, dt = self.spec, self.spec.compute_dtype
        # Gather from a table sharded only by vocab (an FSDP all-gather of its embed dim, as
        # for any weight): each device looks up its vocab range, then one sum combines them.
        table_VD = constrain(self.tok_embed[...].astype(dt), ("vocab", None), spec.rules)
        x_BLD = jnp.take(table_VD, tokens_BL, axis=0)
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
        """The final-normed hidden states that the output head reads. segments_BL and
        positions_BL: packed documents (int32 [B, L]: each position's document, 0 for
        padding, and its position within it); None: one document per row."""
        spec = self.spec
        x_BLD = self._embed(tokens_BL, positions_BL=positions_BL)
        graphdef, stacked = nnx.split(self.blocks)
        policy = REMATS[spec.remat].policy

        def layers(chunk, x_BLD, documents):
            def layer(x_BLD, layer_state):
                return nnx.merge(graphdef, layer_state)(x_BLD, *(documents or ())), None

            if policy is not None:
                layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
            return jax.lax.scan(layer, x_BLD, chunk)[0]

        documents = (segments_BL, positions_BL)
        if spec.pipeline is None:
            x_BLD = layers(stacked, x_BLD, documents)
        else:  # the ids travel with their micro-batch through the stages
            x_BLD = pipeline(layers if segments_BL is not None
                             else lambda chunk, x: layers(chunk, x, None),
                             stacked, x_BLD, spec.pipeline, spec.rules,
                             documents if segments_BL is not None else None)
        return constrain(self.final_norm(x_BLD), ("batch", "length", "embed"), spec.rules)

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
        logits_BLV = self.features(tokens_BL, segments_BL, positions_BL) @ self.head()
        return constrain(logits_BLV, ("batch", "length", "vocab"), self.spec.rules)

    def init_cache(self, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of every layer for `length` positions: [layers, B, M, G, K] each."""
        spec = self.spec
        shape = (spec.num_layers, batch, length, spec.num_kv_heads, spec.head_dim)
        zeros = jnp.zeros(shape, spec.compute_dtype)
        axes = ("layers", "batch", "length", "kv_heads", "kv")
        return constrain(zeros, axes, spec.rules), constrain(zeros, axes, spec.rules)

    def decode(self, tokens_BT: jax.Array, cache: tuple, start: jax.Array):
        """Logits of T new tokens at positions [start, start+T), reading and extending the
        kv cache of the earlier ones (prefill: start 0, T = prompt; then T = 1 per token)."""
        x_BTD = self._embed(tokens_BT, start)
        graphdef, stacked = nnx.split(self.blocks)

        def layer(x_BTD, layer_state_and_cache):
            layer_state, layer_cache = layer_state_and_cache
            return nnx.merge(graphdef, layer_state).decode(x_BTD, layer_cache, start)

        x_BTD, cache = jax.lax.scan(layer, x_BTD, (stacked, cache))
        logits_BTV = self.final_norm(x_BTD) @ self.head()
        return constrain(logits_BTV, ("batch", "length", "vocab"), self.spec.rules), cache

