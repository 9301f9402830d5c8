"""The attention layer: q/k/v/o projections (with LoRA's adapters, models/lora.py), rotary
embeddings, the kernel `model.attention` names (or the context-parallel kernel under
`mesh.context`), and kv-cached decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.mesh import constrain
from jaxtrain.models import lora
from jaxtrain.models.attention import cache as decode_cache
from jaxtrain.models.attention.context import context_attention
from jaxtrain.models.attention.kernels import KERNELS
from jaxtrain.models.attention.xla import decode_attention
from jaxtrain.models.layers import dense, param
from jaxtrain.models.rope import rope

# Names of the tensors remat policies can keep (models/remat.py).
PROJECTION_NAMES = {"q": "query_proj", "k": "key_proj", "v": "value_proj"}
ATTENTION_DOT_NAMES = ("query_proj", "key_proj", "value_proj", "attention_out", "out_proj")


def _rotate(x_BLHK, theta, positions_L, scaling, fraction: float):
    """RoPE over each head's first fraction·K features, the rest as they are
    (model.partial_rotary_factor; transformers' partial rotary: frequencies of that width)."""
    rotary = int(x_BLHK.shape[-1] * fraction)
    if rotary == x_BLHK.shape[-1]:
        return rope(x_BLHK, theta, positions_L, scaling)
    rotated = rope(x_BLHK[..., :rotary], theta, positions_L, scaling)
    return jnp.concatenate([rotated, x_BLHK[..., rotary:]], axis=-1)


class Attention(nnx.Module):
    def __init__(self, spec, *, rngs: nnx.Rngs):
        self.spec = spec
        d, h, g, k = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim
        std, dt = spec.init_std, spec.param_dtype
        out_std = spec.init_std / (2 * spec.num_layers) ** 0.5
        self.w_q = param(rngs, (d, h, k), ("embed", "heads", "kv"), std, dt)
        self.w_k = param(rngs, (d, g, k), ("embed", "kv_heads", "kv"), std, dt)
        self.w_v = param(rngs, (d, g, k), ("embed", "kv_heads", "kv"), std, dt)
        self.w_o = param(rngs, (h, k, d), ("heads", "kv", "embed"), out_std, dt)
        if spec.use_bias:
            self.b_q = param(rngs, (h, k), ("heads", "kv"), 0.0, dt)
            self.b_k = param(rngs, (g, k), ("kv_heads", "kv"), 0.0, dt)
            self.b_v = param(rngs, (g, k), ("kv_heads", "kv"), 0.0, dt)
            self.b_o = param(rngs, (d,), ("embed",), 0.0, dt)
        for part in spec.attention_parts:  # ones and zeros: no random draws
            for name, (shape, axes, init) in part.params(spec).items():
                setattr(self, name, param(rngs, shape, axes, init, dt))
        # After every base weight, so that the base draws the same numbers with or without.
        for name in ("q", "k", "v", "o"):
            setattr(self, f"lora_{name}", lora.adapter(
                spec, "attention", getattr(self, f"w_{name}"), f"w_{name}", 2 if name == "o"
                else 1, rngs))

    def _project(self, x_BLD, name: str, axes) -> jax.Array:
        dt = self.spec.compute_dtype
        w = lora.weight(self.spec, getattr(self, f"w_{name}")[...],
                        getattr(self, f"lora_{name}"))
        y = dense(self.spec, "bld,dhk->blhk", x_BLD, w)
        # Without RoPE the key bias adds q·b_k to every score of a query, which softmax
        # ignores: skipping it keeps its gradient exactly zero rather than float noise that
        # Adam would amplify (the parameter stays, for checkpoints converted from Hugging Face
        # GPT-2). Rotated with the key (gpt-oss), it changes the scores, so it is added.
        if self.spec.use_bias and (name != "k" or self.spec.rope):
            y = y + getattr(self, f"b_{name}")[...].astype(dt)
        for part in self.spec.attention_parts:  # the family's options, before RoPE
            y = part.fn(self, name, y, self.spec)
        y = checkpoint_name(y, PROJECTION_NAMES[name])
        return constrain(y, ("batch", "length") + axes, self.spec.rules)

    def qkv(self, x_BLD, positions_L=None, kind: str | None = None):
        """Projected q (scaled by 1/√head_dim), k and v of the normed input; positions_L
        ([L], or [B, L] restarting at each document) for rotary embeddings (default
        0..L-1); kind: the layer's kind, whose rope it rotates by (None: the model's)."""
        spec = self.spec
        q_BLHK = self._project(x_BLD, "q", ("heads", "kv"))
        k_BLGK = self._project(x_BLD, "k", ("kv_heads", "kv"))
        v_BLGK = self._project(x_BLD, "v", ("kv_heads", "kv"))
        if spec.rope:
            theta, scaling = spec.layer_kind(kind).rope(spec)
            q_BLHK = _rotate(q_BLHK, theta, positions_L, scaling, spec.rope_fraction)
            k_BLGK = _rotate(k_BLGK, theta, positions_L, scaling, spec.rope_fraction)
        q_BLHK = q_BLHK * jnp.asarray((spec.attention_scale_dim or spec.head_dim) ** -0.5,
                                      q_BLHK.dtype)
        return q_BLHK, k_BLGK, v_BLGK

    def gate(self, x_BLD):
        """The output gate's logits [B, L, H, K] of the normed input (family part
        output_gate), or None without the part."""
        if not hasattr(self, "w_gate"):
            return None
        return dense(self.spec, "bld,dhk->blhk", x_BLD, self.w_gate[...])

    def _kernel_parts(self) -> dict:
        """The parameters of the family's attention parts that act inside the kernel (the
        sinks), by the kernel's argument names: {} without such parts."""
        return {p.kernel: getattr(self, p.kernel)[...] for p in self.spec.attention_parts
                if p.kernel}

    def _output(self, out_BLHK, gate_BLHK=None):
        spec = self.spec
        if gate_BLHK is not None:
            out_BLHK = out_BLHK * jax.nn.sigmoid(gate_BLHK.astype(jnp.float32)).astype(
                out_BLHK.dtype)
        out_BLHK = checkpoint_name(out_BLHK, "attention_out")
        out_BLHK = constrain(out_BLHK, ("batch", "length", "heads", "kv"), spec.rules)
        y_BLD = dense(spec, "blhk,hkd->bld", out_BLHK,
                      lora.weight(spec, self.w_o[...], self.lora_o))
        if spec.use_bias:
            y_BLD = y_BLD + self.b_o[...].astype(spec.compute_dtype)
        return checkpoint_name(y_BLD, "out_proj")

    def __call__(self, x_BLD: jax.Array, segments_BL=None, positions_BL=None) -> jax.Array:
        return self.attend(*self.qkv(x_BLD, positions_BL), segments_BL,
                           gate_BLHK=self.gate(x_BLD))

    def attend(self, q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array,
               segments_BL=None, kind: str | None = None, gate_BLHK=None) -> jax.Array:
        """The attention kernel and the output projection, from projected q, k, v;
        segments_BL: document masks (the module docstring), None for none; kind: the
        layer's kind, whose window the kernel takes (None: model.sliding_window's);
        gate_BLHK: the output gate's logits (self.gate), None for none."""
        spec = self.spec
        window = spec.layer_kind(kind).window(spec)
        if spec.context is not None:  # the sequence is split: the kernel passes K/V around
            assert not self._kernel_parts(), "config.py refuses kernel parts under context"
            out_BLHK = context_attention(q_BLHK, k_BLGK, v_BLGK, window, segments_BL,
                                         spec.context, spec.rules)
        else:
            out_BLHK = KERNELS[spec.attention](q_BLHK, k_BLGK, v_BLGK, window,
                                               rules=spec.rules, segments_BL=segments_BL,
                                               softcap=spec.attn_softcap,
                                               **self._kernel_parts())
        return self._output(out_BLHK, gate_BLHK)

    def decode(self, x_BTD: jax.Array, cache: tuple, start: jax.Array,
               kind: str | None = None):
        """T new positions [start, start+T) against the kv cache ([B, G, M, K] each), read
        as it is; returns (y_BTD, their keys and values [B, G, T, K]), which the model
        writes into the cache after its last layer (models/attention/cache.py). start: a
        scalar, or [B] (each row at its own position). A windowed kind's cache keeps every
        position too (the mask hides the ones past its window)."""
        positions_xT = decode_cache.positions(start, x_BTD.shape[1])
        q_BTHK, k_BTGK, v_BTGK = self.qkv(x_BTD, positions_xT, kind)
        new = tuple(n.swapaxes(1, 2).astype(c.dtype) for n, c in zip((k_BTGK, v_BTGK), cache))
        out_BTHK = decode_attention(q_BTHK, cache, new, positions_xT,
                                    self.spec.layer_kind(kind).window(self.spec),
                                    softcap=self.spec.attn_softcap, **self._kernel_parts())
        return self._output(out_BTHK, self.gate(x_BTD)), new
