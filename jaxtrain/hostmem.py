"""Host memory: glibc's malloc backed by transparent huge pages, chosen before start-up.

XLA:CPU takes each step's temporaries fresh from malloc (1.5 GB for configs/bench_cpu.py),
and glibc hands allocations that large straight to the kernel and back: every step then
page-faults through its working set 4 KiB at a time (≈300k faults, ≈10% of the step on a
2-core machine; docs/benchmarks.md). With the tunable glibc.malloc.hugetlb=1 (glibc ≥ 2.35)
malloc asks for transparent huge pages (2 MiB), which cuts the faults ≈25×. glibc reads
tunables only when a process starts, so the entry points (training, benchmarks) execute
themselves again, once, with it set, before they import jax. JAXTRAIN_HUGE_PAGES=0 opts out;
kernels whose transparent huge pages are 'never' and non-glibc systems are left alone.
"""

from __future__ import annotations

import os
import pathlib
import platform
import signal
import sys

TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Linux with glibc and transparent huge pages not switched off."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def huge_pages_requested(environ=os.environ) -> bool:
    return TUNABLE in environ.get("GLIBC_TUNABLES", "")


def environment_with_huge_pages(environ=os.environ) -> dict:
    """environ plus the tunable (other tunables kept)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    setting = f"{TUNABLE}=1"
    return dict(environ, GLIBC_TUNABLES=f"{tunables}:{setting}" if tunables else setting)


def restart_with_huge_pages() -> None:
    """Re-execute this process (same pid, argv and environment plus the tunable) unless it
    already has it, opted out, or the system cannot use it. Call before importing jax."""
    if (os.environ.get("JAXTRAIN_HUGE_PAGES", "1") == "0" or huge_pages_requested()
            or not huge_pages_available()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # A SIGINT/SIGTERM arriving while the new process starts stays pending (a blocked
    # signal survives exec) until jaxtrain/signals.py installs its handlers and unblocks it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    os.execve(sys.executable, sys.orig_argv, environment_with_huge_pages())
