"""Multi-token prediction (MTP, DeepSeek-V3 report §2.2): `depths` sequential modules
that each predict one token further ahead, sharing the model's embedding and output head.

Depth k (1-based) at position i combines the previous depth's representation h^{k-1}_i
(h^0: the main model's) with the embedding of token t_{i+k}:

    h'^k_i = W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]     (W_k: 2d -> d)
    h^k    = TRM_k(h'^k)                                         (a transformer block)
    P^k    = OutHead(RMSNorm(h^k))                               predicts t_{i+k+1}

The concatenation's order and the norms' names follow DeepSeek's checkpoints
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`), as inference engines load them. The loss
is λ/D Σ_k CE(P^k, t_{i+k+1}) over the positions that have a target. The report cuts each
depth's sequence to its T−k positions; here every depth keeps all L positions and masks
those past the end (the blocks are causal, so a kept position never sees a masked one):
the same numbers, with shapes that stay fixed across depths. At inference MTP is optional
(speculative decoding can use it; plain decoding skips it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import fail
from jaxtrain.models.layers import Norm, dense, param


@dataclasses.dataclass(frozen=True)
class MtpSpec:
    """model.mtp, resolved once."""

    depths: int  # num_nextn_predict_layers (transformers: num_mtp_layers)
    loss_weight: float = 0.3  # λ (the report: 0.3, then 0.1 late in training)

    @classmethod
    def from_config(cls, section) -> MtpSpec | None:
        return cls(section.depths, section.loss_weight) if section.depths else None

    def matmul_params(self, d_model: int, block_params: int) -> int:
        """Planner fact: per token, each depth's 2d×d projection and its block (the head's
        matmul is counted by the caller, once per depth)."""
        return self.depths * (2 * d_model * d_model + block_params)


def defaults() -> dict:
    """The `model.mtp` section; depths 0: no MTP."""
    return {"depths": 0, "loss_weight": 0.3}


def check(c) -> None:
    m = c.model.mtp
    if m.depths < 0:
        fail("model.mtp.depths", m.depths, "must be >= 0 (0: no multi-token prediction)")
    if m.depths and m.depths + 2 > c.model.seq_len:
        fail("model.mtp.depths", m.depths, f"must leave a target: at most model.seq_len-2="
             f"{c.model.seq_len - 2}")
    if m.loss_weight < 0:
        fail("model.mtp.loss_weight", m.loss_weight, "must be >= 0")


class MtpDepth(nnx.Module):
    """One depth: its two input norms, its projection, its block and its output norm.
    __call__(h_BLD, emb_BLD) -> (h^k_BLD for the next depth, the normed h^k for the head)."""

    def __init__(self, spec, block: nnx.Module, *, rngs: nnx.Rngs):
        self.spec = spec
        d, dt, eps = spec.d_model, spec.param_dtype, spec.norm_eps
        self.enorm = Norm(d, rms=True, eps=eps, dtype=dt, rngs=rngs)
        self.hnorm = Norm(d, rms=True, eps=eps, dtype=dt, rngs=rngs)
        self.w_eh = param(rngs, (2 * d, d), (None, "embed"), spec.init_std, dt)
        self.block = block
        self.norm = Norm(d, rms=True, eps=eps, dtype=dt, rngs=rngs)

    def __call__(self, h_BLD: jax.Array, emb_BLD: jax.Array):
        both_BLE = jnp.concatenate([self.enorm(emb_BLD), self.hnorm(h_BLD)], axis=-1)
        # block(x) -> (x, aux), as the model's blocks return (aux: a dense block's {})
        h_BLD = self.block(dense(self.spec, "ble,ed->bld", both_BLE, self.w_eh[...]))[0]
        return h_BLD, self.norm(h_BLD)


def mtp_loss(depths, mtp: MtpSpec, h_BLD: jax.Array, tokens_BL: jax.Array,
             embed: Callable, logits: Callable) -> tuple[jax.Array, dict]:
    """(λ/D Σ_k L_k, {mtp_loss_k: L_k}): h_BLD the main model's final representation,
    tokens_BL the row's tokens (the main model predicts t_{i+1} at i); embed: tokens ->
    [B, L, d] (the model's embedding), logits: [B, L, d] -> [B, L, V] (its head)."""
    length = tokens_BL.shape[1]
    losses = {}
    for k, depth in enumerate(depths, start=1):
        # Wrapped-around tokens only reach positions i >= L-k, which are masked below.
        h_BLD, normed_BLD = depth(h_BLD, embed(jnp.roll(tokens_BL, -k, axis=1)))
        target_BL = jnp.roll(tokens_BL, -(k + 1), axis=1)
        logp_BLV = jax.nn.log_softmax(logits(normed_BLD).astype(jnp.float32), axis=-1)
        nll_BL = -jnp.take_along_axis(logp_BLV, target_BL[..., None], axis=-1)[..., 0]
        has_target_L = jnp.arange(length) < length - k - 1
        losses[f"mtp_loss_{k}"] = (nll_BL * has_target_L).sum() / (
            has_target_L.sum() * tokens_BL.shape[0])
    total = mtp.loss_weight * sum(losses.values()) / len(depths)
    return total, losses
