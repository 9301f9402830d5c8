"""The files of the built-in corpus (data.source='stdlib', prepare --stdlib).

Kept apart from the source registry so that `jaxtrain prepare` finds them without loading
grain and jax, which it never uses.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sysconfig

from jaxtrain.errors import DataError


def stdlib_files() -> list[pathlib.Path]:
    """The .py files of this interpreter's standard library, sorted by path. They differ
    between Python versions (31.5 MB on 3.11, 31.7 MB on 3.12, 33.1 MB on 3.13), so a run
    records their fingerprint (jaxtrain.data.record) and refuses to resume on other ones."""
    return list(_stdlib_files())


@functools.cache  # read twice per run (the corpus and its fingerprint); fixed per process
def _stdlib_files() -> tuple[pathlib.Path, ...]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Pruned, not filtered after: site-packages (jax, torch, ...) sits under the stdlib
        # and walking it was most of a CLI start's second and a half here.
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        files += [pathlib.Path(folder, n) for n in names if n.endswith(".py")]
    if not files:
        raise DataError(f"data.source='stdlib' found no .py files under {root}")
    return tuple(sorted(files))
