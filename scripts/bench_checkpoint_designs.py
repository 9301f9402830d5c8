"""Checkpoint save and restore, the staged design against the in-place one, side by side:

    python scripts/bench_checkpoint_designs.py [--mb 256] [--latency-ms 50] [--repeats 3]
        [--staged 08af334] [--markdown]

The staged design (orbax on a local scratch copy, mirrored to the bucket; every restore
downloads the step first) is the commit `--staged` (08af334, the last main before issue 36's
in-place remote tier: an ancestor of main, so in every full clone; a shallow one is refused
in one line), checked out into a temporary git worktree; the in-place one is this checkout.
Its jaxtrain still runs this checkout's bench_storage.py (checked 2026-12-07 with a 1 MB
checkpoint, on disk and on the S3 server). Each repeat runs `scripts/bench_storage.py
--only checkpoint` once per design, in turn, each in a fresh process (the same script,
servers and tree; only the jaxtrain it imports differs: $JAXTRAIN_BENCH_CODE), so both see
the same machine. Printed: the median of each figure over the repeats, per row (local disk,
S3 on 127.0.0.1, S3 with --latency-ms before the first byte of every answer).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ("held_s", "save_s", "restore_s")


def _once(code: pathlib.Path, args) -> dict:
    env = dict(os.environ, JAXTRAIN_BENCH_CODE=str(code))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_storage.py"),
                          "--only", "checkpoint", "--mb", str(args.mb),
                          "--latency-ms", str(args.latency_ms)],
                         env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["checkpoint"]


def _medians(runs: list[dict]) -> dict:
    return {row: {f: statistics.median(r[row][f] for r in runs) for f in FIGURES}
            for row in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--latency-ms", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--staged", default="08af334")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{args.staged}^{{commit}}"],
                           capture_output=True)
    if found.returncode:
        print(f"bench_checkpoint_designs: --staged {args.staged} is not a commit of this "
              "clone (a shallow clone? git fetch --unshallow)", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        staged = pathlib.Path(tmp) / "staged"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(staged), args.staged], check=True)
        try:
            runs: dict[str, list] = {"staged": [], "in place": []}
            for i in range(args.repeats):
                for design, code in (("staged", staged), ("in place", ROOT)):
                    runs[design].append(_once(code, args))
                    print(f"repeat {i + 1}/{args.repeats}: {design} done", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(staged)], check=False)
    result = {design: _medians(r) for design, r in runs.items()}
    result.update(mb=args.mb, repeats=args.repeats, staged_commit=args.staged,
                  date=time.strftime("%Y-%m-%d"))
    if not args.markdown:
        print(json.dumps(result, indent=1))
        return
    print(f"| {args.mb} MB checkpoint | design | training thread held | save (committed) | "
          "MB/s | restore (another host) | MB/s |")
    print("|---|---|---|---|---|---|---|")
    for row in result["staged"]:
        for design in ("staged", "in place"):
            r = result[design][row]
            print(f"| {row} | {design} | {r['held_s']:.2f} s | {r['save_s']:.2f} s | "
                  f"{args.mb / r['save_s']:.0f} | {r['restore_s']:.2f} s | "
                  f"{args.mb / r['restore_s']:.0f} |")


if __name__ == "__main__":
    main()
