"""Attention, one package:

- layer.py       the `Attention` module (projections, LoRA adapters, rotary embeddings,
                 kv-cached decoding), which calls the chosen kernel
- kernels.py     `model.attention`'s registry (KERNELS: `AttentionKernel` entries) and the
                 kernels' contract
- xla.py         the reference kernel; chunked.py and chunked_loop.py the flash-style XLA
                 kernel (unrolled query chunks; loops for long sequences); cudnn.py,
                 pallas_gpu.py, splash.py the vendor kernels
- context.py     the kernel under `mesh.context` (the sequence split over devices);
                 context_variants.py `model.context_attention`'s registry (VARIANTS: how
                 K/V reach every device); context_tiles.py one device's tiles of a block
- scaffold.py    what every kernel shares: the grouped layout, head folding, masks, the
                 recomputing custom VJP
- flash.py       the online-softmax tile math of the looped kernels
- cache.py       what cached decoding shares (GQA's and MLA's): positions, masks, the
                 cache's axes and the write of every layer's new entries after the stack
"""

from jaxtrain.models.attention.cache import KV_AXES, LATENT_AXES
from jaxtrain.models.attention.context_tiles import computed_scores
from jaxtrain.models.attention.context_variants import (
    VARIANTS,
    ContextVariant,
    resolve_variant,
)
from jaxtrain.models.attention.kernels import KERNELS, AttentionKernel, resolve_attention
from jaxtrain.models.attention.layer import ATTENTION_DOT_NAMES, PROJECTION_NAMES, Attention
from jaxtrain.models.attention.xla import xla_attention

__all__ = ["ATTENTION_DOT_NAMES", "KERNELS", "KV_AXES", "LATENT_AXES", "PROJECTION_NAMES",
           "VARIANTS", "Attention", "AttentionKernel", "ContextVariant", "computed_scores",
           "resolve_attention", "resolve_variant", "xla_attention"]
