"""Decoder-only Transformer: GPT-2 and Llama families, layers stacked and scanned."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.mesh import active_rules, constrain
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models.attention import ATTENTION_DOT_NAMES, Attention
from jaxtrain.models.layers import Norm, dense, gelu, param
from jaxtrain.parallel.pipeline import PipelineSpec, pipeline

MLP_DOT_NAMES = ("mlp_up", "mlp_gate", "mlp_down")
WEIGHT_DOT_NAMES = tuple(n for n in ATTENTION_DOT_NAMES if n != "attention_out") + MLP_DOT_NAMES
_policies = jax.checkpoint_policies
# What each remat policy keeps from the forward pass; everything else is recomputed.
REMAT_POLICIES = {
    "full": _policies.nothing_saveable,
    # Weight matmul outputs are kept; attention scores (batched dots) are recomputed. The
    # weight matmuls run under a custom VJP (layers.dense), which the dot rule cannot see
    # into, so their outputs are also kept by name.
    "save_dots": _policies.save_from_both_policies(
        _policies.dots_with_no_batch_dims_saveable,
        _policies.save_only_these_names(*WEIGHT_DOT_NAMES)),
    # The attention projections and output; the (larger) MLP matmuls are recomputed.
    "save_dots_except_mlp": _policies.save_only_these_names(*ATTENTION_DOT_NAMES),
    # Only the attention kernel's output: the cheapest place to cut an expensive recompute.
    "save_attention_out": _policies.save_only_these_names("attention_out"),
    # Every named matmul output, moved to host memory between forward and backward.
    "offload_dots": _policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[
            *ATTENTION_DOT_NAMES, *MLP_DOT_NAMES],
        offload_src="device", offload_dst="pinned_host"),
}


def resolve_attention(name: str, precision: str, platform: str, seq_len: int = 128) -> str:
    """'auto': cuDNN's fused kernel where it runs (NVIDIA GPUs, 16-bit compute), the splash
    kernel on TPUs (sequences in blocks of 128), else the chunked causal attention, which
    beats the reference on every backend measured. 'pallas' is jax's Pallas kernel for the
    backend: Triton flash attention on GPUs, splash attention on TPUs."""
    if name == "pallas" and platform == "tpu":
        return "splash"
    if name != "auto":
        return name
    if platform == "tpu" and seq_len % 128 == 0:
        return "splash"
    return "cudnn" if platform == "gpu" and precision != "float32" else "chunked"


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
        compute = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
                   "fp8": jnp.bfloat16}[cfg.train.precision]
        return cls(
            family=m.family, d_model=m.d_model, num_layers=m.num_layers,
            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads or m.num_heads,
            head_dim=m.head_dim or m.d_model // m.num_heads, mlp_dim=m.mlp_dim,
            vocab_size=m.vocab_size, seq_len=m.seq_len,
            attention=resolve_attention(m.attention, cfg.train.precision, platform, m.seq_len),
            sliding_window=m.sliding_window,
            remat=m.remat, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
            init_std=m.init_std, compute_dtype=compute,
            rules=active_rules(tuple(tuple(r) for r in cfg.mesh.rules),
                               cfg.mesh.sequence_parallel),
            pipeline=pipeline, fp8=cfg.train.precision == "fp8")

    @property
    def is_llama(self) -> bool:
        return self.family == "llama"

    # GPT-2: learned positions, LayerNorm, GELU, biases, tied embeddings.
    # Llama: RoPE, RMSNorm, SwiGLU, no biases, separate output head.
    use_bias = property(lambda self: not self.is_llama)
    rope = property(lambda self: self.is_llama)
    tied_embeddings = property(lambda self: not self.is_llama)


def _activation_and_down(spec, h_BLF, gate_BLF, b_up_F, w_down_FD):
    """GELU(h + b) (GPT-2) or SiLU(gate)·h (Llama), then the down projection."""
    dt = spec.compute_dtype
    if spec.is_llama:
        a_BLF = jax.nn.silu(gate_BLF) * h_BLF
    else:
        a_BLF = gelu(h_BLF + b_up_F.astype(dt))
    a_BLF = constrain(a_BLF, ("batch", "length", "mlp"), spec.rules)
    return dense(spec, "blf,fd->bld", a_BLF, w_down_FD)


class Mlp(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        self.spec = spec
        d, f, dt = spec.d_model, spec.mlp_dim, spec.param_dtype
        out_std = spec.init_std / (2 * spec.num_layers) ** 0.5
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), spec.init_std, dt)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), out_std, dt)
        if spec.is_llama:
            self.w_gate = param(rngs, (d, f), ("embed", "mlp"), spec.init_std, dt)
        else:
            self.b_up = param(rngs, (f,), ("mlp",), 0.0, dt)
            self.b_down = param(rngs, (d,), ("embed",), 0.0, dt)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        return self.down(*self.up(x_BLD))

    def up(self, x_BLD: jax.Array):
        """The up (and, for Llama, gate) projections: (h_BLF, gate_BLF or None)."""
        spec = self.spec
        h_BLF = checkpoint_name(dense(spec, "bld,df->blf", x_BLD, self.w_up[...]), "mlp_up")
        gate_BLF = None
        if spec.is_llama:
            gate_BLF = checkpoint_name(dense(spec, "bld,df->blf", x_BLD, self.w_gate[...]),
                                       "mlp_gate")
        return h_BLF, gate_BLF

    def down(self, h_BLF: jax.Array, gate_BLF: jax.Array | None) -> jax.Array:
        spec = self.spec
        b_up_F = None if spec.is_llama else self.b_up[...]
        # Rematerialised: the backward pass recomputes the activation from the up projection
        # (kept anyway) instead of keeping its B·L·F output per layer for the down
        # projection's weight gradient. XLA drops the recomputed down projection itself,
        # which the backward does not need.
        y_BLD = jax.checkpoint(functools.partial(_activation_and_down, spec))(
            h_BLF, gate_BLF, b_up_F, self.w_down[...])
        y_BLD = checkpoint_name(y_BLD, "mlp_down")
        if not spec.is_llama:
            y_BLD = y_BLD + self.b_down[...].astype(spec.compute_dtype)
        return y_BLD


class Block(nnx.Module):
    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        norm = dict(rms=spec.is_llama, eps=spec.norm_eps, dtype=spec.param_dtype, rngs=rngs)
        self.spec = spec
        self.attn_norm = Norm(spec.d_model, **norm)
        self.attn = Attention(spec, rngs=rngs)
        self.mlp_norm = Norm(spec.d_model, **norm)
        self.mlp = Mlp(spec, rngs=rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        q_BLHK, k_BLGK, v_BLGK = self._norm_then(
            lambda x: self.attn.qkv(self.attn_norm(x)))(x_BLD)
        x_BLD = x_BLD + self.attn.attend(q_BLHK, k_BLGK, v_BLGK)
        return self._mlp_residual(x_BLD)

    def _norm_then(self, norm_and_project):
        """Without a remat policy, each norm and the projections reading it are recomputed
        in the backward pass from the norm's input: the projections' weight gradients then
        do not keep the norm's output, nor the norm its own statistics (one B·L·D tensor
        per norm instead of two; configs/bench_cpu.py: −3% step time, −10% temporaries).
        XLA drops the recomputed matmuls, which the backward pass does not use. Under a
        remat policy, the policy decides what is kept."""
        if self.spec.remat != "none":
            return norm_and_project
        return jax.checkpoint(norm_and_project, policy=_policies.nothing_saveable)

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
        self.final_norm = Norm(d, rms=spec.is_llama, eps=spec.norm_eps, dtype=dt, rngs=rngs)
        if not spec.tied_embeddings:
            self.lm_head = param(rngs, (d, v), ("embed", "vocab"), spec.init_std, dt)

    def _embed(self, tokens_BL: jax.Array, start=0) -> jax.Array:
        spec, dt = self.spec, self.spec.compute_dtype
        # Gather from a table sharded only by vocab (an FSDP all-gather of its embed dim, as
        # for any weight): each device looks up its vocab range, then one sum combines them.
        table_VD = constrain(self.tok_embed[...].astype(dt), ("vocab", None), spec.rules)
        x_BLD = jnp.take(table_VD, tokens_BL, axis=0)
        if not spec.rope:
            positions_LD = jax.lax.dynamic_slice_in_dim(self.pos_embed[...], start,
                                                        tokens_BL.shape[1])
            x_BLD = x_BLD + positions_LD.astype(dt)
        return constrain(x_BLD, ("batch", "sequence", "embed"), spec.rules)

    def features(self, tokens_BL: jax.Array) -> jax.Array:
        """The final-normed hidden states that the output head reads."""
        spec = self.spec
        x_BLD = self._embed(tokens_BL)

        graphdef, stacked = nnx.split(self.blocks)

        def layer(x_BLD, layer_state):
            return nnx.merge(graphdef, layer_state)(x_BLD), None

        if spec.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[spec.remat], prevent_cse=False)
        if spec.pipeline is None:
            x_BLD, _ = jax.lax.scan(layer, x_BLD, stacked)
        else:
            def stage(chunk, x_BLD):
                return jax.lax.scan(layer, x_BLD, chunk)[0]

            x_BLD = pipeline(stage, stacked, x_BLD, spec.pipeline, spec.rules)
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

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        logits_BLV = self.features(tokens_BL) @ self.head()
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

