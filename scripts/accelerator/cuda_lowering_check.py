"""The train step lowered for CUDA without a GPU, per attention kernel × precision: the table
of docs/benchmarks.md ("CUDA lowering of the train step, checked on CPU"). The lowering and
what each row must show are tests/cuda_lowering.py's, which
tests/unit/test_accelerator_checks.py holds every row to.

    python scripts/accelerator/cuda_lowering_check.py [--json] [--kernels cudnn,pallas]
        [--precisions fp8] [--packing documents]

Exit code 1 when a row has a problem (a lowering that fails is one).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from cuda_lowering import KERNELS, PRECISIONS, check  # noqa: E402


def run(kernels, precisions, packing: str = "concat") -> list[dict]:
    rows = []
    for kernel in kernels:
        for precision in precisions:
            try:
                row = check(kernel, precision, packing)
            except Exception as e:  # noqa: BLE001 - a refusal is a finding too
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                row = {"kernel": kernel, "precision": precision, "packing": packing,
                       "error": error, "problems": [error]}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--packing", default="concat", choices=("concat", "documents"),
                        help="documents: the document-mask paths (segment ids)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.kernels.split(","), args.precisions.split(","), args.packing)
    if args.json:
        print(json.dumps(rows))
    else:
        print("| kernel | precision | custom calls | matmul operand types | f32 batched "
              "(attention) matmuls | problems |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            calls = ", ".join(f"{k} ×{v}" for k, v in r.get("custom_calls", {}).items())
            dots = ", ".join(f"{k} ×{v}" for k, v in r.get("dot_operand_types", {}).items())
            print(f"| {r['kernel']} | {r['precision']} | {calls or '–'} | {dots or '–'} | "
                  f"{r.get('f32_batched_dots', '–')} | {'; '.join(r['problems']) or 'none'} |")
    sys.exit(1 if any(r["problems"] for r in rows) else 0)


if __name__ == "__main__":
    main()
