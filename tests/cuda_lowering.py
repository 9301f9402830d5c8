"""The train step lowered for CUDA on a machine without a GPU, and what the lowered module
holds: per attention kernel × precision of a small llama_1b-shaped model (GQA, RoPE,
SwiGLU), the custom calls (cuDNN fused attention, Triton kernels), host fallbacks (Python
callbacks: there should be none), and the matmuls' operand types (a 16-bit policy should
run no float32×float32 matmul: neither of model width nor a batched one of attention; fp8
should run f8 matmuls).

tests/unit/test_accelerator_checks.py holds every kernel × precision to `problems` (none);
scripts/accelerator/cuda_lowering_check.py prints the table docs/benchmarks.md shows.

Lowered with `jit(...).trace(...).lower(lowering_platforms=("cuda",))`: the same lowering
jax.export(platforms=("cuda",)) performs, without export's refusal of custom calls that
have no serialization guarantee (cuDNN's). Two things cannot be had without a GPU and are
stubbed here, said so in the output: jax asks the CUDA plugin for the cuDNN version before
lowering cuDNN attention (no plugin: "cuDNN is not detected"), and the Pallas kernel picks
interpret mode on a CPU default backend. Compiling for CUDA (XLA's GPU passes, the cuDNN
graph itself, Triton's PTX) needs a GPU: scripts/accelerator/gpu_check.sh does that on the
day.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
from unittest import mock

import jax
from flax import nnx

from jaxtrain.config import apply_overrides, load_config_file
from jaxtrain.train import state as state_lib
from jaxtrain.train.setup import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = ("cudnn", "pallas", "chunked", "xla")
PRECISIONS = ("bfloat16", "float16", "fp8")
# llama_1b's shape, narrowed and shortened so that each lowering takes seconds.
SMALL = {"model.d_model": 256, "model.num_layers": 2, "model.num_heads": 8,
         "model.num_kv_heads": 2, "model.mlp_dim": 1024, "model.vocab_size": 1024,
         "model.seq_len": 256, "train.global_batch": 2, "mesh.fsdp": 1, "mesh.data": 1}
_DOT = re.compile(r"stablehlo\.dot_general .*?: \(tensor<([^>]*)>, tensor<([^>]*)>\) -> "
                  r"tensor<([^>]*)>")
_CUSTOM = re.compile(r"stablehlo\.custom_call @([\w$.\-]+)")
HOST_TARGETS = ("callback", "host")


@contextlib.contextmanager
def _gpu_stubs(kernel: str):
    """What lowering asks of a GPU that is not there (see the module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    with contextlib.ExitStack() as stack:
        if kernel == "cudnn":
            stack.enter_context(mock.patch.object(cudnn, "check_cudnn_version",
                                                  lambda: 91000))
            stack.enter_context(mock.patch.object(  # an H100/H200
                cudnn, "check_compute_capability", lambda capability: True))
        if kernel == "pallas":  # compile the Triton kernel, not its CPU interpretation
            stack.enter_context(mock.patch.object(jax, "default_backend", lambda: "gpu"))
        yield


def lower_for_cuda(kernel: str, precision: str, overrides: dict | None = None) -> str:
    """StableHLO text of the train step of the small llama for CUDA."""
    cfg = apply_overrides(load_config_file(os.path.join(ROOT, "configs/llama_1b.py")),
                          {**SMALL, **(overrides or {}), "train.precision": precision,
                           "model.attention": "xla"})
    setup = build(cfg, jax.devices()[:1])
    # build() refuses GPU kernels on CPU devices; the spec and graph are rebuilt with the
    # kernel asked for (the lowering targets CUDA, whatever devices the mesh holds).
    spec = dataclasses.replace(setup.spec, attention=kernel)
    setup = dataclasses.replace(setup, spec=spec,
                                graphdef=nnx.graphdef(state_lib.abstract_model(spec)))
    tokens = setup.abstract_batch()  # a Packed batch with data.packing='documents'
    state = setup.abstract_step_state()
    with _gpu_stubs(kernel), jax.set_mesh(setup.mesh):
        traced = setup.train_step().trace(state, tokens)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


def inspect(text: str, width: int) -> dict:
    """Custom calls, host fallbacks, and the operand types of the matmuls: weight matmuls
    (2-D operands: the layers flatten tokens) and batched ones (attention scores and their
    gradients)."""
    calls = collections.Counter(_CUSTOM.findall(text))
    dots = collections.Counter()
    f32_weight, f32_batched = 0, 0
    for lhs, rhs, _ in _DOT.findall(text):
        kinds = tuple(t.rsplit("x", 1)[-1] for t in (lhs, rhs))
        dots["×".join(kinds)] += 1
        shapes = [[int(d) for d in t.split("x")[:-1]] for t in (lhs, rhs)]
        if kinds != ("f32", "f32"):
            continue
        if all(len(s) == 2 for s in shapes) and max(max(s) for s in shapes) >= width:
            f32_weight += 1
        elif any(len(s) > 2 for s in shapes):
            f32_batched += 1
    return {"custom_calls": dict(calls), "dot_operand_types": dict(dots),
            "f32_weight_dots": f32_weight, "f32_batched_dots": f32_batched,
            "host_fallbacks": sorted(t for t in calls
                                     if any(h in t.lower() for h in HOST_TARGETS))}


def problems(row: dict) -> list[str]:
    """What a CUDA lowering of this kernel and precision must show."""
    out = []
    kernel, precision, found = row["kernel"], row["precision"], row
    if found["host_fallbacks"]:
        out.append(f"host fallbacks {found['host_fallbacks']}")
    if kernel == "cudnn" and not any("cudnn$fmha" in t for t in found["custom_calls"]):
        out.append("no cuDNN fused-attention custom call")
    if kernel == "pallas" and not any("triton" in t for t in found["custom_calls"]):
        out.append("no Triton kernel")
    if found["f32_weight_dots"]:
        out.append(f"{found['f32_weight_dots']} float32 weight matmuls in a {precision} "
                   "policy")
    if found["f32_batched_dots"]:  # P and dS belong in the compute dtype, as flash kernels do
        out.append(f"{found['f32_batched_dots']} float32 attention matmuls in a {precision} "
                   "policy")
    if precision == "fp8" and not any("f8" in k for k in found["dot_operand_types"]):
        out.append("no fp8 matmul")
    return out


def check(kernel: str, precision: str, packing: str = "concat") -> dict:
    """One kernel × precision lowered and inspected, with its problems. packing
    'documents': the document-mask paths (segment ids)."""
    overrides = ({} if packing == "concat" else
                 {"data.packing": packing, "data.source": "synthetic"})
    row = {"kernel": kernel, "precision": precision, "packing": packing,
           **inspect(lower_for_cuda(kernel, precision, overrides), SMALL["model.d_model"])}
    return {**row, "problems": problems(row)}
