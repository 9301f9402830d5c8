"""The feed-forward block: GELU (up, GELU, down), SwiGLU (SiLU(gate)·up, down) or GeGLU
(tanh-GELU(gate)·up, down), as the model family's `mlp` field says."""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.mesh import constrain
from jaxtrain.models import lora
from jaxtrain.models.layers import dense, gelu, param

# Names of the tensors remat policies can keep (models/remat.py).
MLP_DOT_NAMES = ("mlp_up", "mlp_gate", "mlp_down")


def _activation_and_down(spec, h_BLF, gate_BLF, b_up_F, w_down_FD):
    """GELU(h + b) or SiLU(gate)·h, then the down projection."""
    dt = spec.compute_dtype
    if spec.family_entry.mlp == "geglu":
        a_BLF = gelu(gate_BLF) * h_BLF
    elif spec.gated_mlp:
        a_BLF = jax.nn.silu(gate_BLF) * h_BLF
    else:
        a_BLF = gelu(h_BLF + b_up_F.astype(dt)) if b_up_F is not None else gelu(h_BLF)
    a_BLF = constrain(a_BLF, ("batch", "length", "mlp"), spec.rules)
    return dense(spec, "blf,fd->bld", a_BLF, w_down_FD)


class Mlp(nnx.Module):
    def __init__(self, spec, *, rngs: nnx.Rngs, width: int | None = None):
        """width: the hidden dimension (default model.mlp_dim; MoE shared experts differ)."""
        self.spec = spec
        d, f, dt = spec.d_model, width or spec.mlp_dim, spec.param_dtype
        out_std = spec.init_std / (2 * spec.num_layers) ** 0.5
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), spec.init_std, dt)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), out_std, dt)
        if spec.gated_mlp:
            self.w_gate = param(rngs, (d, f), ("embed", "mlp"), spec.init_std, dt)
        if spec.use_bias:
            self.b_up = param(rngs, (f,), ("mlp",), 0.0, dt)
            self.b_down = param(rngs, (d,), ("embed",), 0.0, dt)
        for name in ("up", "gate", "down"):  # after the base weights: the same draws
            w = getattr(self, f"w_{name}", None)
            setattr(self, f"lora_{name}", None if w is None else
                    lora.adapter(spec, "mlp", w, f"w_{name}", 1, rngs))

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        return self.down(*self.up(x_BLD))

    def _w(self, name: str):
        return lora.weight(self.spec, getattr(self, f"w_{name}")[...],
                           getattr(self, f"lora_{name}"))

    def up(self, x_BLD: jax.Array):
        """The up (and, when gated, gate) projections: (h_BLF, gate_BLF or None)."""
        spec = self.spec
        h_BLF = checkpoint_name(dense(spec, "bld,df->blf", x_BLD, self._w("up")), "mlp_up")
        gate_BLF = None
        if spec.gated_mlp:
            gate_BLF = checkpoint_name(dense(spec, "bld,df->blf", x_BLD, self._w("gate")),
                                       "mlp_gate")
        return h_BLF, gate_BLF

    def down(self, h_BLF: jax.Array, gate_BLF: jax.Array | None) -> jax.Array:
        spec = self.spec
        b_up_F = self.b_up[...] if spec.use_bias else None
        # Rematerialised: the backward pass recomputes the activation from the up projection
        # (kept anyway) instead of keeping its B·L·F output per layer for the down
        # projection's weight gradient. XLA drops the recomputed down projection itself,
        # which the backward does not need.
        y_BLD = jax.checkpoint(functools.partial(_activation_and_down, spec))(
            h_BLF, gate_BLF, b_up_F, self._w("down"))
        y_BLD = checkpoint_name(y_BLD, "mlp_down")
        if spec.use_bias:
            y_BLD = y_BLD + self.b_down[...].astype(spec.compute_dtype)
        return y_BLD
