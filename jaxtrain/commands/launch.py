"""Local multi-process launcher, for laptops and tests, with supervised restarts:

    jaxtrain launch --processes N --devices-per-process K [--max-restarts R] \
        -- <jaxtrain train args>

Starts N processes of `jaxtrain train` on this machine, each with K fake CPU devices, joined
by jax.distributed (gloo collectives). Their output is prefixed with the rank. When a rank
dies (killed, out of memory, an exception, the hang watchdog), the others are stopped at
once (SIGTERM, then SIGKILL after GRACE_S) and, up to R times, the whole job is started
again: it resumes from the newest intact checkpoint. Config errors (exit 2) and a run that
stopped itself (exit 3) are not retried. A workdir in use by another run (exit 75: a lease
not yet stale, or one this run lost) is retried after the lease's takeover time
($JAXTRAIN_LEASE_STALE_S, 300 s), the longest a dead run's lease can stand in the way; it
counts as a restart. Ctrl-C or SIGTERM to the launcher stops every rank at the same step
with a checkpoint, and is not retried either.
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

from jaxtrain import storage
from jaxtrain.commands.common import exit_usage, flag_value
from jaxtrain.errors import IN_USE, ConfigError
from jaxtrain.lease import lease_times
from jaxtrain.xla_flags import with_device_count

GRACE_S = 10  # between SIGTERM and SIGKILL for the surviving ranks
NOT_RETRIED = (2, 3)  # config/input error; the run stopped itself (non-finite steps)
# IN_USE (75) is retried, after in_use_wait_s(): a dead run's lease is stale by then.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(rank: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[rank {rank}] {line}")
        out.flush()


def _say(message: str) -> None:
    print(f"jaxtrain.launch: {message}", file=sys.stderr, flush=True)


class Job:
    """One start of the N ranks."""

    def __init__(self, processes: int, devices_per_process: int, main_args: list[str]):
        port = _free_port()
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
                   XLA_FLAGS=with_device_count(devices_per_process))
        self.ranks = []
        for rank in range(processes):
            cmd = [sys.executable, "-m", "jaxtrain.main", *main_args,
                   f"--coordinator=127.0.0.1:{port}", f"--num_processes={processes}",
                   f"--process_id={rank}"]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, bufsize=1)
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                threading.Thread(target=_pump, args=(rank, stream, out), daemon=True).start()
            self.ranks.append(proc)

    def signal_all(self, sig=signal.SIGTERM) -> None:
        for proc in self.ranks:
            if proc.poll() is None:
                proc.send_signal(sig)

    def wait(self, poll_s: float) -> tuple[int, int | None]:
        """(exit status, failed rank or None): 0 when every rank exits 0; else the first
        failure's status, once the other ranks are stopped too."""
        while True:
            codes = [proc.poll() for proc in self.ranks]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                _say(f"rank {rank} failed with exit status {code}; stopping the other ranks")
                self.stop_others(poll_s)
                return (code if code > 0 else 128 - code), rank
            if all(code == 0 for code in codes):
                return 0, None
            time.sleep(poll_s)

    def stop_others(self, poll_s: float) -> None:
        self.signal_all(signal.SIGTERM)
        deadline = time.time() + GRACE_S
        while time.time() < deadline and any(p.poll() is None for p in self.ranks):
            time.sleep(poll_s)
        self.signal_all(signal.SIGKILL)
        for proc in self.ranks:
            proc.wait()


def launch(processes: int, devices_per_process: int, main_args: list[str],
           max_restarts: int = 0, poll_s: float = 0.2) -> int:
    stopping = threading.Event()
    job = None

    def stop(*_) -> None:
        # Every rank saves the same step (jax's preemption sync point) and exits.
        stopping.set()
        if job is not None:
            job.signal_all(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for attempt in range(max_restarts + 1):
        job = Job(processes, devices_per_process, main_args)
        code, rank = job.wait(poll_s)
        if code == 0 or stopping.is_set() or code in NOT_RETRIED:
            return code
        if attempt < max_restarts:
            wait = in_use_wait_s() if code == IN_USE else 0.0
            _say(f"restarting the job ({attempt + 1} of {max_restarts}) after rank {rank} "
                 f"exited with status {code}"
                 + (f" (the workdir is in use) in {wait:g}s, when a dead run's lease is "
                    "stale" if wait else "") + "; it resumes from its newest checkpoint")
            if stopping.wait(wait):
                return code
    return code


def in_use_wait_s() -> float:
    """How long a launcher waits before retrying a run refused with IN_USE: the lease's
    takeover time ($JAXTRAIN_LEASE_STALE_S), after which a dead holder's lease is stale."""
    return lease_times()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="jaxtrain launch",
                                     description=__doc__.split("\n\n")[0],
                                     usage="jaxtrain launch --processes N "
                                           "--devices-per-process K [--max-restarts R] -- "
                                           "<train args>")
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="start the job again up to this many times when a rank dies")
    parser.add_argument("main_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    main_args = args.main_args[1:] if args.main_args[:1] == ["--"] else args.main_args
    if args.processes < 1 or args.devices_per_process < 1 or args.max_restarts < 0:
        parser.error("--processes and --devices-per-process must be >= 1, --max-restarts >= 0")
    try:  # here, not in each rank: one line, before any rank starts
        workdir = flag_value(main_args, "workdir") or ""
        storage.check_path(workdir, "--workdir")
    except ConfigError as e:
        exit_usage(str(e))
    sys.exit(launch(args.processes, args.devices_per_process, main_args, args.max_restarts))


if __name__ == "__main__":
    main()
