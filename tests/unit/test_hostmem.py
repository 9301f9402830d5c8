"""The entry points restart once with glibc's huge-page tunable (jaxtrain/hostmem.py)."""

import os
import subprocess
import sys

import pytest

from jaxtrain import hostmem

_PRINT_TUNABLES = ("from jaxtrain import hostmem; hostmem.restart_with_huge_pages(); "
                   "import os; print(os.environ.get('GLIBC_TUNABLES', ''))")


def _run(**env_changes) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "JAXTRAIN_HUGE_PAGES")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", _PRINT_TUNABLES], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not hostmem.huge_pages_available(),
                    reason="needs Linux, glibc and transparent huge pages")
def test_restarts_with_the_tunable_once_keeping_other_tunables():
    assert _run() == "glibc.malloc.hugetlb=1"
    assert _run(GLIBC_TUNABLES="glibc.malloc.arena_max=2") == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    assert _run(GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"


def test_opt_out_leaves_the_process_alone():
    assert _run(JAXTRAIN_HUGE_PAGES="0") == ""
