"""Precision policies: one registry entry per `train.precision` value.

Parameters, gradients and optimizer moments stay float32 in every policy (mixed precision
with float32 master weights); a policy decides the dtype the model computes in, whether the
loss is scaled, whether the blocks' weight matmuls take fp8 operands, and which datasheet
peak MFU is judged against. The planner reads the same entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    compute_dtype: Any
    doc: str
    # Dynamic loss scaling (float16's narrow exponent underflows small gradients).
    loss_scaling: bool = False
    # The blocks' weight matmuls take fp8 operands (models/fp8.py).
    fp8_matmuls: bool = False
    # The hardware catalog's peak its matmuls run at (hardware.json flops_tflops: fp32, bf16,
    # fp8; the catalog lists fp16 with bf16, the same tensor-core rate); "": the compute
    # dtype's (fp32 for float32, else bf16).
    matmul_peak: str = ""

    @property
    def datasheet_peak(self) -> str:
        """The hardware catalog's figure the planner's step time divides by."""
        if self.matmul_peak:
            return self.matmul_peak
        return "fp32" if self.compute_dtype == jnp.float32 else "bf16"

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation value on an accelerator (the planner's traffic and memory)."""
        return jnp.dtype(self.compute_dtype).itemsize

    @property
    def peak(self) -> str:
        """The datasheet peak MFU divides by: 16-bit and fp8 runs are judged against the
        bf16 peak (fp8 MFU is often quoted that way)."""
        return "float32" if self.compute_dtype == jnp.float32 else "bfloat16"


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("float32", jnp.float32, "float32 everywhere"),
    Precision("bfloat16", jnp.bfloat16, "bf16 compute, float32 master weights"),
    Precision("float16", jnp.float16, "fp16 compute with dynamic loss scaling",
              loss_scaling=True),
    Precision("fp8", jnp.bfloat16, "bf16 compute, fp8 (e4m3/e5m2) weight-matmul operands",
              fp8_matmuls=True, matmul_peak="fp8"),
)}
