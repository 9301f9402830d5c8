"""cuDNN's fused flash attention (NVIDIA GPUs, bf16/fp16), with optional document masks.

Causal rows go through `jax.nn.dot_product_attention(implementation="cudnn")`. For document
masks (models/attention/kernels.py: segment ids), what jax 0.10.2 offers:

- `jax.nn.dot_product_attention` takes, for cuDNN, per-row lengths (`query_seq_lengths`:
  padding at the end of each row, one document per row) and a boolean `mask`, which it turns
  into a dense additive bias [B, 1, L, L] that cuDNN reads in full: any GPU, but an L×L
  tensor per row.
- cuDNN's packed ("ragged") layout, in `jax._src.cudnn.fused_attention_stablehlo.
  dot_product_attention`: each row is a run of segments given by their offsets and lengths
  ([B, M+1] and [B, M], -1 past a row's last segment), each attended causally on its own;
  no L×L tensor. It needs a Hopper or newer GPU (jax checks when it traces).

So documents take the packed layout on compute capability 9.0 and up (H100/H200/B200), the
dense mask on older GPUs. M, the static bound on segments per row, is `max_segments(L)`: the
packer (data/packing.py) gives every document part at least 2 tokens and puts padding (one
more segment) only at the row's end, so L positions hold at most L // 2 + 1 runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn


def max_segments(length: int) -> int:
    """Segments (contiguous runs of one id) a row of `length` positions may hold."""
    return length // 2 + 1


def packed_layout(segments_BL: jax.Array, most: int):
    """(offsets [B, most+1], lengths [B, most]) of the runs of equal ids in each row, -1
    past its last run: cuDNN's packed layout."""
    b, length = segments_BL.shape
    starts_BL = jnp.concatenate([jnp.ones((b, 1), bool),
                                 segments_BL[:, 1:] != segments_BL[:, :-1]], axis=1)
    run_BL = jnp.cumsum(starts_BL, axis=1, dtype=jnp.int32) - 1
    runs_B = run_BL[:, -1] + 1
    lengths_BM = jax.vmap(lambda r: jnp.zeros(most, jnp.int32).at[r].add(1, mode="drop"))(
        run_BL)
    offsets_BM = jnp.cumsum(lengths_BM, axis=1, dtype=jnp.int32) - lengths_BM
    live_BM = jnp.arange(most)[None, :] < runs_B[:, None]
    offsets_BM1 = jnp.concatenate([jnp.where(live_BM, offsets_BM, -1),
                                   jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return offsets_BM1, jnp.where(live_BM, lengths_BM, -1)


def _hopper_or_newer() -> bool:
    """Whether the GPU takes the packed layout; True where no GPU answers (an ahead-of-time
    lowering targets the GPUs this project runs on: H100/H200/B200)."""
    try:
        return cudnn.check_compute_capability("9.0")
    except Exception:  # noqa: BLE001 - no CUDA device to ask
        return True


def cudnn_attention(q_BLHK: jax.Array, k_BMGK: jax.Array, v_BMGK: jax.Array,
                    window: int | None = None, segments_BL=None) -> jax.Array:
    """Causal grouped-query attention by cuDNN; q arrives pre-scaled."""
    local = None if window is None else (window - 1, 0)
    if segments_BL is None:
        return jax.nn.dot_product_attention(q_BLHK, k_BMGK, v_BMGK, scale=1.0, is_causal=True,
                                            implementation="cudnn", local_window_size=local)
    if not _hopper_or_newer():
        mask_B1LM = (segments_BL[:, :, None] == segments_BL[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q_BLHK, k_BMGK, v_BMGK, mask=mask_B1LM,
                                            scale=1.0, is_causal=True, implementation="cudnn",
                                            local_window_size=local)
    heads, groups = q_BLHK.shape[2], k_BMGK.shape[2]
    if groups != heads:
        # jax scales the packed key offsets by the query heads' stride (N·H per token), so
        # keys and values are given as many heads as the queries.
        k_BMGK = jnp.repeat(k_BMGK, heads // groups, axis=2)
        v_BMGK = jnp.repeat(v_BMGK, heads // groups, axis=2)
    offsets, lengths = packed_layout(segments_BL, max_segments(q_BLHK.shape[1]))
    return cudnn.dot_product_attention(
        q_BLHK, k_BMGK, v_BMGK, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
        kv_offsets=offsets, scale=1.0, mask_type=cudnn.MaskType.PADDING_CAUSAL,
        sliding_window_length=window)
