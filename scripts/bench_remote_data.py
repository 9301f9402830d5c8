"""The data wait of a run reading its tokens from object storage with latency:

    python scripts/bench_remote_data.py [--latency-ms 50] [--step-s 3.2] [--steps 12]
                                        [--block-kb 64,256,1024] [--markdown]

A 64 MiB uint16 `.bin` file is uploaded to moto's S3 server on 127.0.0.1 (tests/servers.py),
whose proxy adds --latency-ms before the first byte of every answer; configs/bench_cpu.py's
batch shape (8 rows of 513 tokens) is then read through `Batches.train_iter` with
data.source=bin and data.path=s3://..., a sleep of --step-s standing in for each train step
(pass bench_cpu's measured step: scripts/bench_train.py). Reported per block size: the wait for
the first batch (read when the first step asks for it) and the mean wait of the later steps,
as a share of the step: what `data_wait_s` would show in metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _waits(url: str, block_kb: int, step_s: float, steps: int) -> dict:
    from jaxtrain.config import apply_overrides, load_config_file
    from jaxtrain.data import remote_file
    from jaxtrain.data.batches import make_batches

    cfg = apply_overrides(load_config_file(ROOT / "configs" / "bench_cpu.py"),
                          {"data.source": "bin", "data.path": url, "data.dtype": "uint16",
                           "data.block_kb": block_kb})
    remote_file.reset_stats()
    iterator = make_batches(cfg).train_iter(0)
    waits = []
    for _ in range(steps):
        began = time.perf_counter()
        next(iterator)
        waits.append(time.perf_counter() - began)
        time.sleep(step_s)
    later = float(np.mean(waits[1:]))
    return {"block_kb": block_kb, "first_s": waits[0], "later_s": later,
            "share": later / step_s, "requests": remote_file.stats()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-ms", type=float, default=50)
    parser.add_argument("--step-s", type=float, default=3.2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--block-kb", default="64,256,1024")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    from servers import start

    from jaxtrain import storage

    server = start("s3")
    try:
        url = f"{server.bucket()}/tokens.bin"
        with tempfile.TemporaryDirectory() as tmp:
            local = pathlib.Path(tmp) / "tokens.bin"
            rng = np.random.default_rng(0)
            rng.integers(0, 32000, 32 << 20, dtype=np.uint16).tofile(local)
            fs, path = storage.filesystem(url)
            fs.put_file(str(local), path)
        server.proxy.delay_s = args.latency_ms / 1000
        rows = [_waits(url, int(kb), args.step_s, args.steps)
                for kb in args.block_kb.split(",")]
    finally:
        server.stop()
    if not args.markdown:
        print(json.dumps({"latency_ms": args.latency_ms, "step_s": args.step_s, "rows": rows,
                          "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()},
                         indent=1))
        return
    print(f"| data.block_kb | first batch | mean wait per later step | share of a "
          f"{args.step_s} s step | range requests |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['block_kb']} | {r['first_s']:.2f} s | {r['later_s'] * 1000:.1f} ms | "
              f"{r['share']:.2%} | {r['requests'].get('requests', '?')} |")


if __name__ == "__main__":
    main()
