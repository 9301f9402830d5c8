"""Every attention kernel that runs on this backend against the reference, one JSON line each
(the rows of tests/attention_accuracy.py: cuDNN and Pallas in bfloat16 on a GPU):

    python scripts/accelerator/attention_check.py [--length 1024]

gpu_check.sh runs it on the lent GPU; on CPU, tests/unit/test_accelerator_checks.py runs the
same rows.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from attention_accuracy import rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=1024)
    args = parser.parse_args()
    for row in rows(args.length):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
