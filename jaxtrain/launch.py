"""Local multi-process launcher, for laptops and tests:

    python -m jaxtrain.launch --processes N --devices-per-process K -- <jaxtrain.main args>

Starts N processes of jaxtrain.main on this machine, each with K fake CPU devices, joined by
jax.distributed (gloo collectives). Their output is prefixed with the rank. If one rank
fails, the others are stopped at once and the launcher exits non-zero naming that rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 10  # between SIGTERM and SIGKILL for the surviving ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(rank: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[rank {rank}] {line}")
        out.flush()


def launch(processes: int, devices_per_process: int, main_args: list[str],
           poll_s: float = 0.2) -> int:
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
    ranks = []
    for rank in range(processes):
        cmd = [sys.executable, "-m", "jaxtrain.main", *main_args,
               f"--coordinator=127.0.0.1:{port}", f"--num_processes={processes}",
               f"--process_id={rank}"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, bufsize=1)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            threading.Thread(target=_pump, args=(rank, stream, out), daemon=True).start()
        ranks.append(proc)

    def stop_all(sig=signal.SIGTERM) -> None:
        for proc in ranks:
            if proc.poll() is None:
                proc.send_signal(sig)

    # Forward Ctrl-C / SIGTERM to every rank: each saves its checkpoint shard and exits.
    signal.signal(signal.SIGTERM, lambda *_: stop_all())
    signal.signal(signal.SIGINT, lambda *_: stop_all(signal.SIGINT))

    while True:
        codes = [proc.poll() for proc in ranks]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"jaxtrain.launch: rank {rank} failed with exit status {code}; stopping the "
                  "other ranks", file=sys.stderr, flush=True)
            stop_all()
            deadline = time.time() + GRACE_S
            while time.time() < deadline and any(p.poll() is None for p in ranks):
                time.sleep(poll_s)
            stop_all(signal.SIGKILL)
            for proc in ranks:
                proc.wait()
            return code if code > 0 else 128 - code
        if all(code == 0 for code in codes):
            return 0
        time.sleep(poll_s)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="python -m jaxtrain.launch --processes N "
                                           "--devices-per-process K -- <main args>")
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("main_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    main_args = args.main_args[1:] if args.main_args[:1] == ["--"] else args.main_args
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    sys.exit(launch(args.processes, args.devices_per_process, main_args))


if __name__ == "__main__":
    main()
