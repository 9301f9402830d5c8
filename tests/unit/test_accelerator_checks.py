"""Evidence for accelerators gathered without one: the train step lowered for CUDA
(scripts/cuda_lowering_check.py) and the GPU check script's CPU rehearsal
(scripts/gpu_check.sh --rehearse)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import cuda_lowering_check as cuda  # noqa: E402


@pytest.mark.parametrize("kernel,precision,expected", [
    ("cudnn", "bfloat16", "__cudnn$fmhaSoftmaxBackward"),
    ("pallas", "fp8", "__gpu$xla.gpu.triton"),
])
def test_train_step_lowers_for_cuda_with_its_kernels(kernel, precision, expected):
    found = cuda.inspect(cuda.lower_for_cuda(kernel, precision), cuda.SMALL["model.d_model"])
    row = {"kernel": kernel, "precision": precision, **found}
    assert expected in found["custom_calls"]
    assert cuda.problems(row) == []
    assert found["f32_weight_dots"] == 0 and not found["host_fallbacks"]
    if precision == "fp8":
        assert found["dot_operand_types"].get("f8E4M3FN×f8E4M3FN", 0) > 0


def test_lowering_check_flags_what_is_missing():
    text = cuda.lower_for_cuda("xla", "bfloat16")
    found = cuda.inspect(text, cuda.SMALL["model.d_model"])
    # An xla-kernel module offered as cuDNN's, or as fp8, is caught.
    assert any("cuDNN" in p for p in cuda.problems({"kernel": "cudnn", "precision": "bfloat16",
                                                    **found}))
    assert any("fp8" in p for p in cuda.problems({"kernel": "xla", "precision": "fp8", **found}))
    f32 = cuda.inspect(text.replace("xbf16>", "xf32>"), cuda.SMALL["model.d_model"])
    assert f32["f32_weight_dots"] > 0
    assert any("attention matmuls" in p for p in cuda.problems({"kernel": "xla",
                                                                "precision": "bfloat16", **f32}))


# The kernels written in XLA keep their backward's matmuls on 16-bit operands (P and dS cast
# as flash kernels do, float32 accumulation): the chunked kernel unrolled (2 query chunks),
# looped (17 chunks: lowered only, never compiled, so the long sequence costs seconds), and
# the reference.
@pytest.mark.parametrize("kernel,seq_len", [("chunked", 256), ("chunked", 2176), ("xla", 256)])
def test_attention_matmuls_are_16_bit_in_a_16_bit_policy(kernel, seq_len):
    from jaxtrain.models.attention.chunked import looped

    assert looped(seq_len, 128) == (seq_len > 2048)  # the chunked kernel's 128-row chunks
    found = cuda.inspect(cuda.lower_for_cuda(kernel, "bfloat16", {"model.seq_len": seq_len}),
                         cuda.SMALL["model.d_model"])
    assert found["f32_batched_dots"] == 0, found["dot_operand_types"]
    assert cuda.problems({"kernel": kernel, "precision": "bfloat16", **found}) == []


@pytest.mark.slow
def test_gpu_check_rehearses_on_cpu(tmp_path):
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts/gpu_check.sh"), "--rehearse",
                          str(tmp_path)], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_report.json").read_text())
    status = {r["check"]: r["status"] for r in rows}
    assert status["matmul_peak"] == "ok" and status["llama_1b bf16 chunked"] == "ok"
    assert status["llama_1b fp8 chunked"] == "ok" and status["llama_1b bf16 cudnn"] == "skipped"
    bench = next(r for r in rows if r["check"] == "llama_1b bf16 chunked")
    assert bench["planner"]["step_s"] > 0 and 0.5 < bench["planner"]["memory_ratio"] < 2
    assert (tmp_path / "gpu_report.md").read_text().count("|") > 20
