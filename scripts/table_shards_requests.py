"""What an in-place checkpoint (jaxtrain/checkpoint_shards.py) costs, per process, as the
object store's server gets it:

    python scripts/table_shards_requests.py [--processes 1 2 4] [--schemes s3 gs] [--checkpoints]

For each emulator (moto's S3 server, fake-gcs-server: tests/servers.py) and each process
count N, runs tests/shards_worker.py (`both`: a save, then its restore) as N processes of
2 devices each (jax.distributed, gloo), each process's client behind a TCP proxy of its
own, and prints: the write requests and objects of one checkpoint, then per process at
the restore (same mesh) the GETs and the bytes received (HTTP headers included) against
1/N of the state plus the step's metadata (its marker and indices), and the bytes left on
the host's disk (JAXTRAIN_SCRATCH and HOME). The state is the worker's: 3 leaves sharded
over every device and one replicated counter, 57,360 bytes. About a minute on 2 CPU cores.
With --checkpoints, the same through jaxtrain's Checkpoints on the bucket (its remote
tier), on the worker's larger state (917,520 bytes). docs/operations.md quotes its output.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _disk(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(scheme: str, processes: int) -> None:
    import servers
    from test_checkpoint_shards import _job

    from jaxtrain import storage
    server = servers.start(scheme)
    try:
        url = server.bucket() + "/run/checkpoints"
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="jaxtrain-shards-"))
        reports = _job(processes, url, "both", 4, server, scratch)
        store = storage.kvstore(f"{url}/4")
        objects = [k.decode() for k in store.list().result()]
        metadata = sum(len(store.read(k).result().value) for k in objects if k.endswith("json"))
        writes = sum(n for r in reports for m, n in r["requests"].items() if m in ("PUT", "POST"))
        print(f"{scheme} x{processes}: a checkpoint: {writes} write requests, "
              f"{len(objects)} objects; its metadata {metadata} bytes")
        for rank, r in enumerate(reports):
            assert r["rc"] == 0 and r["problem"] is None and r["bitwise"], r["err"]
            share = r["state_bytes"] // processes
            print(f"    process {rank}: restore {r['requests'].get('GET', 0)} GETs, "
                  f"{r['received'].get('GET', 0)} bytes received (1/N of the state {share} "
                  f"+ metadata = {share + metadata}); local disk {_disk(scratch)} bytes")
    finally:
        server.stop()


def measure_checkpoints(scheme: str, processes: int) -> None:
    """The same through jaxtrain's Checkpoints (the remote tier): one job saves step 4 and
    marks it healthy (`keep`), a second job restores it (`resume`); the writes are the first
    job's, the reads the second's (its start's listing and markers included)."""
    import servers
    from test_checkpoint_shards import _job

    from jaxtrain import storage
    server = servers.start(scheme)
    try:
        url = server.bucket() + "/run/checkpoints"
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="jaxtrain-shards-"))
        saved = _job(processes, url, "keep", 0, server, scratch)
        assert all(r["rc"] == 0 for r in saved), saved[0]["err"]
        reports = _job(processes, url, "resume", 0, server, scratch)
        objects = storage.kv_keys(url)
        metadata = sum(len(storage.kvstore(url).read(k).result().value)
                       for k in objects if k.endswith("json"))
        writes = sum(n for r in saved for m, n in r["requests"].items() if m in ("PUT", "POST"))
        print(f"{scheme} x{processes} (Checkpoints): a checkpoint and its health mark: "
              f"{writes} write requests, {len(objects)} objects; metadata {metadata} bytes")
        for rank, r in enumerate(reports):
            assert r["rc"] == 0 and r["step"] == 4 and r["bitwise"], r["err"]
            share = r["state_bytes"] // processes
            print(f"    process {rank}: start and restore {r['requests'].get('GET', 0)} GETs, "
                  f"{r['received'].get('GET', 0)} bytes received (1/N of the state {share} "
                  f"+ metadata = {share + metadata}); local disk {_disk(scratch)} bytes")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--schemes", nargs="+", default=["s3", "gs"])
    parser.add_argument("--checkpoints", action="store_true",
                        help="through jaxtrain's Checkpoints (a state of ~0.9 MB)")
    args = parser.parse_args()
    for scheme in args.schemes:
        for processes in args.processes:
            (measure_checkpoints if args.checkpoints else measure)(scheme, processes)


if __name__ == "__main__":
    main()
