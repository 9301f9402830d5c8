"""Object storage against local disk, measured side by side in one process:

    python scripts/bench_storage.py [--mb 256] [--latency-ms 50] [--markdown]

- checkpoint: save (until committed, uploaded and manifested) and restore (from an empty
  scratch disk: everything downloaded) of a pytree of --mb MB of float32, to a local
  directory and to moto's S3 server on 127.0.0.1 (tests/servers.py), with the HTTP requests
  each one made, counted at the proxy in front of the server;
- metrics: the requests a run's metrics log makes for one flush of 100 rows;
- a run: the tiny config trained with its workdir on the S3 server for --steps and for
  3 × --steps steps (one checkpoint, at the end): the requests of start-up and end (the
  shorter run) and, from the difference, the requests per minute of training (timed
  flushes of metrics and goodput, the lease's heartbeat, TensorBoard uploads).

The S3 server is local, so its figures are this machine's CPU and loopback, not a real
bucket's bandwidth: what they show is the overhead of the staging and the request counts
(which is what object storage bills).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The jaxtrain to measure: this checkout's, or another commit's worktree
# (scripts/bench_checkpoint_designs.py sets it to compare two designs side by side).
CODE = pathlib.Path(os.environ.get("JAXTRAIN_BENCH_CODE", ROOT))
sys.path.insert(0, str(CODE))
sys.path.insert(0, str(ROOT / "tests"))


def _tree(mb: int):
    import jax.numpy as jnp
    leaves = 8
    n = mb * (1 << 20) // 4 // leaves
    return {f"w{i}": jnp.arange(n, dtype=jnp.float32) * (i + 1) for i in range(leaves)}


def _checkpoint(directory, tree, scratch: pathlib.Path) -> dict:
    import jax
    import numpy as np

    from jaxtrain.checkpoint import Checkpoints

    os.environ["JAXTRAIN_SCRATCH"] = str(scratch / "save")
    saver = Checkpoints(directory, keep=2, log=lambda _: None)
    began = time.perf_counter()
    saver.save(1, tree, {"bench": True})
    held = time.perf_counter() - began
    saver.wait()
    saved = time.perf_counter() - began
    saver.close()
    os.environ["JAXTRAIN_SCRATCH"] = str(scratch / "restore")  # another host
    reader = Checkpoints(directory, keep=2, log=lambda _: None, read_only=True)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=x.sharding), tree)
    began = time.perf_counter()
    restored = reader.restore(1, target)
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - began
    reader.close()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored),
                                                    jax.tree.leaves(tree)))
    return {"held_s": held, "save_s": saved, "restore_s": restore_s}


def _metrics_requests(server, bucket: str) -> dict:
    from jaxtrain import storage
    from jaxtrain.metrics_log import FLUSH_S, MetricsLog

    before = dict(server.proxy.requests)
    log = MetricsLog(storage.as_path(f"{bucket}/metrics-run"))
    for step in range(1, 101):
        log.write({"step": step, "loss": 1.0 / step})
    log.flush()
    log.close()
    made = {k: v - before.get(k, 0) for k, v in server.proxy.requests.items()}
    return {"rows": 100, "requests": made, "flush_s": FLUSH_S}


def _run(server, bucket: str, steps: int, scratch: pathlib.Path) -> dict:
    import subprocess
    before = dict(server.proxy.requests)
    env = dict(os.environ, **server.env(), JAXTRAIN_SCRATCH=str(scratch),
               JAXTRAIN_HUGE_PAGES="0")
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config", "configs/tiny.py",
                    f"--config.steps={steps}", f"--config.checkpoint.every_steps={steps}",
                    f"--config.eval_every_steps={steps}",
                    f"--workdir={bucket}/run-{steps}"], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    wall = time.perf_counter() - began
    made = {k: v - before.get(k, 0) for k, v in server.proxy.requests.items()}
    return {"steps": steps, "wall_s": wall, "requests": made}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--latency-ms", type=int, default=50)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--only", choices=["checkpoint"],
                        help="measure the checkpoint rows only (no metrics, no runs)")
    args = parser.parse_args()
    from servers import start

    server = start("s3")
    try:
        bucket = server.bucket()
        tree = _tree(args.mb)
        rows = {}
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            rows["local disk"] = _checkpoint(tmp / "local" / "checkpoints", tree, tmp / "a")
            before = dict(server.proxy.requests)
            from jaxtrain import storage
            rows["S3 (moto, 127.0.0.1)"] = _checkpoint(
                storage.as_path(f"{bucket}/run/checkpoints"), tree, tmp / "b")
            rows["S3 (moto, 127.0.0.1)"]["requests"] = {
                k: v - before.get(k, 0) for k, v in server.proxy.requests.items()}
            # Slow storage: the training thread is held no longer (the upload is async).
            server.proxy.delay_s = args.latency_ms / 1000
            rows[f"S3 + {args.latency_ms} ms per response"] = _checkpoint(
                storage.as_path(f"{bucket}/slow/checkpoints"), tree, tmp / "c")
            server.proxy.delay_s = 0.0
        if args.only == "checkpoint":
            print(json.dumps({"mb": args.mb, "checkpoint": rows}))
            return
        metrics = _metrics_requests(server, bucket)
        with tempfile.TemporaryDirectory() as tmp:
            runs = [_run(server, bucket, n, pathlib.Path(tmp) / str(n))
                    for n in (args.steps, 3 * args.steps)]
    finally:
        server.stop()
    short, long = runs
    minutes = (long["wall_s"] - short["wall_s"]) / 60
    per_minute = {k: (long["requests"].get(k, 0) - short["requests"].get(k, 0)) / minutes
                  for k in long["requests"]}
    result = {"mb": args.mb, "checkpoint": rows, "metrics": metrics, "runs": runs,
              "requests_per_training_minute": per_minute,
              "date": time.strftime("%Y-%m-%d")}
    if not args.markdown:
        print(json.dumps(result, indent=1))
        return
    print(f"| {args.mb} MB checkpoint | training thread held | save (committed) | MB/s | "
          "restore (empty scratch) | MB/s | requests |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        requests = ", ".join(f"{k} {v}" for k, v in sorted(r.get("requests", {}).items()))
        print(f"| {name} | {r['held_s']:.2f} s | {r['save_s']:.2f} s | "
              f"{args.mb / r['save_s']:.0f} | "
              f"{r['restore_s']:.2f} s | {args.mb / r['restore_s']:.0f} | {requests or '–'} |")
    print(f"\nmetrics log: {metrics['rows']} rows, one flush: {metrics['requests']}")
    print(f"\ntiny run, {short['steps']} steps in {short['wall_s']:.0f} s (start-up, one "
          f"checkpoint, end): {short['requests']}")
    print(f"{long['steps']} steps in {long['wall_s']:.0f} s; per minute of training beyond: "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_minute.items())))


if __name__ == "__main__":
    main()
