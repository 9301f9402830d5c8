"""Attention: the layer, its kernels (the `model.attention` registry) and the
context-parallel kernel (the `model.context_attention` registry)."""

from jaxtrain.models.attention.context import VARIANTS, ContextVariant, resolve_variant
from jaxtrain.models.attention.kernels import (
    ATTENTION_DOT_NAMES,
    KERNELS,
    PROJECTION_NAMES,
    Attention,
    AttentionKernel,
    resolve_attention,
    xla_attention,
)

__all__ = ["ATTENTION_DOT_NAMES", "KERNELS", "PROJECTION_NAMES", "VARIANTS", "Attention",
           "AttentionKernel", "ContextVariant", "resolve_attention", "resolve_variant",
           "xla_attention"]
