"""The requests a run makes of object storage, by kind and purpose, as the server gets them:

    python scripts/table_storage_requests.py [--steps 4] [--every 2] [--beats 4]

Starts moto's S3 server on 127.0.0.1 behind the tests' TCP proxy (tests/servers.py), which
here also logs each request's line (method, path, query: what object storage bills), then
- trains configs/tiny.py for --steps steps with its workdir in a bucket (`jaxtrain train`,
  a subprocess, a checkpoint every --every steps), and lists what start-up, the steps and
  the end asked for;
- holds the workdir lease alone (jaxtrain/lease.py), once without a heartbeat and once for
  --beats heartbeats 0.5 s apart: the difference is what a heartbeat asks for;
- prints what a minute of training costs besides checkpoints: the lease's heartbeat every
  30 s, the metrics segment and goodput.json written once a minute each (one PUT per write:
  the run's are listed), TensorBoard's upload every 2 minutes.

Takes about 15 s on a 2-core CPU with a warm XLA compile cache (a minute cold).
docs/operations.md quotes its output.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# The workdir's objects by what they are for (the first part of the key below the workdir).
PURPOSES = {".lock": "lease", ".write_test": "workdir write probe", "checkpoints": "checkpoint",
            "checkpoint_manifests": "checkpoint manifest", "metrics": "metrics log",
            "tensorboard": "tensorboard", "tokenizer": "tokenizer", "config.json": "config.json",
            "data.json": "data.json", "goodput.json": "goodput.json"}


def _purpose(key: str, run: str) -> str:
    rest = key[len(run):].lstrip("/") if key.startswith(run) else key
    if not rest:
        return "the workdir itself"
    head = rest.split("/", 1)[0]
    return next((p for prefix, p in PURPOSES.items() if head.startswith(prefix)), head)


def classify(line: str, run: str) -> tuple[str, str]:
    """(kind, purpose) of one request line ('PUT /bucket/key?query HTTP/1.1'): kind is its
    method, LIST for a listing, DELETE-MANY for a batch delete."""
    method, target = line.split(" ")[:2]
    url = urllib.parse.urlparse(target)
    query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
    parts = url.path.lstrip("/").split("/", 1)
    key = urllib.parse.unquote(parts[1]) if len(parts) > 1 else ""
    if method == "GET" and not key and ("list-type" in query or "prefix" in query):
        return "LIST", _purpose(parts[0] + "/" + query.get("prefix", [""])[0], run)
    if method == "POST" and "delete" in query:
        return "DELETE-MANY", "checkpoint rotation"
    return method, _purpose(parts[0] + "/" + key, run)


class Recording:
    """Each request line the proxy forwarded, in order; `take()`: those since the last."""

    def __init__(self, proxy):
        self.lines: list[str] = []
        self.taken = 0
        original = proxy._pipe
        methods = proxy.METHODS

        class Logged:  # the client's socket, its requests' first lines logged
            def __init__(self, sock):
                self.sock = sock

            def recv(inner, n):
                chunk = inner.sock.recv(n)
                if chunk.startswith(methods):
                    self.lines.append(chunk.split(b"\r\n", 1)[0].decode("latin-1"))
                return chunk

            def __getattr__(inner, name):
                return getattr(inner.sock, name)

        def pipe(src, dst, asked, upstream):
            if upstream:
                src = Logged(src)
            return original(src, dst, asked, upstream)

        proxy._pipe = pipe

    def take(self) -> list[str]:
        time.sleep(0.2)  # the last answers' threads
        lines, self.taken = self.lines[self.taken:], len(self.lines)
        return lines


def _table(title: str, entries: list[str], run: str) -> collections.Counter:
    counts = collections.Counter(classify(line, run) for line in entries)
    print(f"\n{title}: {sum(counts.values())} requests")
    for (kind, purpose), n in sorted(counts.items(), key=lambda x: (x[0][1], x[0][0])):
        print(f"  {n:4d}  {kind:<11s} {purpose}")
    return counts


def _train(server, workdir: str, steps: int, every: int, scratch: pathlib.Path) -> None:
    env = dict(os.environ, **server.env(), JAXTRAIN_SCRATCH=str(scratch),
               JAXTRAIN_HUGE_PAGES="0", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config", "configs/tiny.py",
                          f"--config.steps={steps}", f"--config.checkpoint.every_steps={every}",
                          f"--config.eval_every_steps={steps}", "--workdir", workdir],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"the training run failed:\n{out.stderr[-3000:]}")


def _lease(workdir: str, beats: int) -> None:
    from jaxtrain.lease import Lease
    lease = Lease(workdir, say=lambda _: None, heartbeat_s=0.5, stale_s=10)
    lease.acquire()
    time.sleep(0.5 * beats + 0.25)
    lease.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    parser.add_argument("--beats", type=int, default=4)
    args = parser.parse_args()
    temp = pathlib.Path(tempfile.mkdtemp(prefix="jaxtrain-requests-"))
    from servers import S3Server

    server = S3Server()
    try:
        os.environ.update(server.env())
        recording = Recording(server.proxy)
        bucket = server.bucket()  # made directly, not through the proxy
        name = bucket.split("://", 1)[1]
        _train(server, f"{bucket}/run", args.steps, args.every, temp / "scratch")
        run = _table(f"`jaxtrain train` of configs/tiny.py: {args.steps} steps, a checkpoint "
                     f"every {args.every} (start-up, steps, end)", recording.take(),
                     f"{name}/run")
        _lease(f"{bucket}/idle", 0)
        idle = _table("the lease alone: acquire and release", recording.take(),
                      f"{name}/idle")
        _lease(f"{bucket}/lease", args.beats)
        lease = _table(f"the lease alone: acquire, {args.beats} heartbeats, release",
                       recording.take(), f"{name}/lease")
    finally:
        server.stop()
    _per_minute(run, idle, lease, args.beats)


def _per_minute(run: collections.Counter, idle: collections.Counter,
                lease: collections.Counter, beats: int) -> None:
    """A minute of training besides checkpoints, from the counts measured above."""
    heartbeat = (sum(lease.values()) - sum(idle.values())) / beats
    kinds = ", ".join(f"{n // beats} {kind}" for (kind, _), n in sorted((lease - idle).items()))
    segment = 1  # a segment is one PUT (jaxtrain/metrics_log.py); the run's are listed above
    tensorboard = run[("PUT", "tensorboard")]
    minute = 2 * heartbeat + segment + 1 + tensorboard / 2
    print("\na minute of training besides checkpoints:")
    print(f"  {2 * heartbeat:5.1f}  the lease: {heartbeat:g} requests per heartbeat ({kinds}), "
          "every 30 s")
    print(f"  {segment:5.1f}  a metrics segment (one PUT per flush), once a minute")
    print("    1.0  goodput.json (one PUT per write), once a minute")
    print(f"  {tensorboard / 2:5.1f}  TensorBoard: {tensorboard} PUT per upload (its event "
          "files), every 2 minutes")
    print(f"  {minute:5.1f}  in all: {minute * 60:.0f} an hour")


if __name__ == "__main__":
    main()
