"""The numbers docs/operations.md quotes about reliability, measured on this machine:

    python scripts/bench_reliability.py [--gb 1] [--heartbeat 10]

- checksum: xxh3 over a file of --gb GB (what a manifest costs per GB, off the training
  thread) and a full verification read of it;
- save: a checkpoint of configs/bench_cpu.py's train state (≈0.6 GB with Adam moments):
  the time the training thread is held, the time to commit, and to write the manifest;
- dead rank: two local processes of the tiny model joined by jax.distributed with
  distributed.heartbeat_timeout_s=--heartbeat; rank 1 is killed and the time until rank 0
  exits (non-zero) is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def checksum(gb: float, directory: pathlib.Path) -> dict:
    from jaxtrain.checkpoint import file_checksum

    path = directory / "blob"
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for _ in range(max(1, int(gb * 1e9) // len(chunk))):
            f.write(chunk)
    size = path.stat().st_size
    began = time.perf_counter()
    file_checksum(path)
    seconds = time.perf_counter() - began
    path.unlink()
    return {"check": "checksum", "bytes": size, "seconds": round(seconds, 3),
            "gb_per_s": round(size / seconds / 1e9, 2)}


def save(directory: pathlib.Path) -> dict:
    import jax

    from jaxtrain.checkpoint import Checkpoints
    from jaxtrain.config import load_config_file
    from jaxtrain.train.setup import build

    cfg = load_config_file(ROOT / "configs/bench_cpu.py")
    setup = build(cfg, jax.devices()[:1])
    tree = setup.init_state().tree()
    size = sum(x.nbytes for x in jax.tree.leaves(tree))
    checkpoints = Checkpoints(directory / "checkpoints", keep=3)
    result = {"check": "save", "state_bytes": size}
    for step in (1, 2):  # the first save of a process also sets orbax up
        began = time.perf_counter()
        checkpoints.save(step, tree, cfg.to_dict())
        held = time.perf_counter() - began
        checkpoints.manager.wait_until_finished()
        committed = time.perf_counter() - began
        checkpoints.wait()
        manifested = time.perf_counter() - began
        result[f"save{step}"] = {"training_thread_held_s": round(held, 3),
                                 "committed_s": round(committed, 3),
                                 "with_manifest_s": round(manifested, 3)}
    began = time.perf_counter()
    result["verified"] = checkpoints.verify(2) is None
    result["verify_s"] = round(time.perf_counter() - began, 3)
    checkpoints.close()
    return result


def dead_rank(heartbeat: int, directory: pathlib.Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    args = ["--config", "configs/tiny.py", "--config.steps=100000", "--config.log_every_steps=1",
            "--config.mesh.data=4", f"--config.distributed.heartbeat_timeout_s={heartbeat}",
            f"--workdir={directory / 'run'}", f"--coordinator=127.0.0.1:{port}",
            "--num_processes=2"]
    ranks = [subprocess.Popen([sys.executable, "-m", "jaxtrain.main", *args,
                               f"--process_id={rank}"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for rank in range(2)]
    metrics = directory / "run" / "metrics.jsonl"
    try:
        while not (metrics.exists() and '"loss"' in metrics.read_text()):
            time.sleep(0.1)
        ranks[1].kill()
        killed = time.perf_counter()
        code = ranks[0].wait(timeout=600)
        detected = time.perf_counter() - killed
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    return {"check": "dead_rank", "heartbeat_timeout_s": heartbeat,
            "survivor_exit_s": round(detected, 1), "survivor_exit_code": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--heartbeat", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        results = [checksum(args.gb, tmp), save(tmp / "save"),
                   dead_rank(args.heartbeat, tmp / "dead")]
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
