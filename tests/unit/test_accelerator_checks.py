"""Evidence for accelerators gathered without one: the train step lowered for CUDA
(tests/cuda_lowering.py), the attention check's rows on CPU (tests/attention_accuracy.py)
and the GPU check script's CPU rehearsal (scripts/accelerator/gpu_check.sh --rehearse)."""

import json
import os
import subprocess

import attention_accuracy
import cuda_lowering as cuda
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


# The rest of the table docs/benchmarks.md shows (scripts/accelerator/cuda_lowering_check.py
# prints it): every kernel × precision the tests above do not lower, and the document-mask
# paths of the kernels written in XLA. Slow: 14 lowerings of about a second each.
@pytest.mark.slow
@pytest.mark.parametrize("kernel,precision,packing", [
    *[(k, p, "concat") for k in cuda.KERNELS for p in cuda.PRECISIONS
      if (k, p) not in {("cudnn", "bfloat16"), ("pallas", "fp8"), ("chunked", "bfloat16"),
                        ("xla", "bfloat16")}],
    *[(k, p, "documents") for k in ("chunked", "xla") for p in cuda.PRECISIONS]])
def test_every_kernel_and_precision_lowers_for_cuda_without_problems(kernel, precision,
                                                                     packing):
    row = cuda.check(kernel, precision, packing)
    assert row["problems"] == [], row


@pytest.mark.slow  # eight small compiles, for a check whose point is a GPU's kernels
def test_the_attention_check_rows_on_cpu():
    """What gpu_check.sh runs for cuDNN and Pallas on a GPU, here for the chunked kernel in
    float32 at a small shape (tests/unit/test_attention.py holds the kernel itself): every
    row computed, outputs and gradients those of the reference."""
    rows = list(attention_accuracy.rows(length=128, windows=(None, 32), shape=(1, 4, 2, 32)))
    assert [(r["impl"], r["window"]) for r in rows] == [("chunked", None), ("chunked", 32)]
    for row in rows:
        assert "error" not in row, row
        assert row["dtype"] == "float32" and row["fwd_bwd_ms"] > 0
        assert row["out_rel_err"] < 1e-5 and row["grad_rel_err"] < 1e-5, row


@pytest.mark.slow
def test_gpu_check_rehearses_on_cpu(tmp_path):
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts/accelerator/gpu_check.sh"),
                          "--rehearse", str(tmp_path)], capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_report.json").read_text())
    status = {r["check"]: r["status"] for r in rows}
    assert status["matmul_peak"] == "ok" and status["llama_1b bf16 chunked"] == "ok"
    assert status["llama_1b fp8 chunked"] == "ok" and status["llama_1b bf16 cudnn"] == "skipped"
    bench = next(r for r in rows if r["check"] == "llama_1b bf16 chunked")
    assert bench["planner"]["step_s"] > 0 and 0.5 < bench["planner"]["memory_ratio"] < 2
    assert (tmp_path / "gpu_report.md").read_text().count("|") > 20
