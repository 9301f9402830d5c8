"""jax's Pallas flash-attention kernel for GPUs (Triton), with the kernels' contract
(models/attention/kernels.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pallas_attention(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array,
                     window: int | None = None, segments_BL=None) -> jax.Array:
    """jax's Pallas flash-attention kernel for GPUs (Triton); interpreted on CPU, for tests.
    It takes segment ids ([B, L], compared per block) for document masks.

    The kernel wants as many kv heads as query heads, so grouped kv heads are repeated. It
    has no sliding window (its KERNELS entry says so, and config.validate refuses that
    combination before anything compiles).
    """
    if window is not None:
        raise ValueError("the Pallas GPU attention kernel has no sliding window")
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    heads, groups, length = q_BLHK.shape[2], k_BMGK.shape[2], q_BLHK.shape[1]
    if groups != heads:
        k_BMGK = jnp.repeat(k_BMGK, heads // groups, axis=2)
        v_BMGK = jnp.repeat(v_BMGK, heads // groups, axis=2)
    block = next(b for b in (128, 64, 32, 16, 8, 4, 2, 1) if length % b == 0)
    blocks = pallas_gpu.BlockSizes(block_q=block, block_k=block, block_q_dkv=block,
                                   block_kv_dkv=block, block_q_dq=block, block_kv_dq=block)
    return pallas_gpu.mha(q_BLHK, k_BMGK, v_BMGK, segments_BL, sm_scale=1.0, causal=True,
                          block_sizes=blocks, interpret=jax.default_backend() == "cpu")
