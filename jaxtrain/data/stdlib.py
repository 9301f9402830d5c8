"""The files of the built-in corpus (data.source='stdlib', prepare --stdlib).

Kept apart from the source registry so that `jaxtrain prepare` finds them without loading
grain and jax, which it never uses.
"""

from __future__ import annotations

import pathlib
import sysconfig

from jaxtrain.errors import DataError


def stdlib_files() -> list[pathlib.Path]:
    """The .py files of this interpreter's standard library, sorted by path. They differ
    between Python versions (31.5 MB on 3.11, 31.7 MB on 3.12, 33.1 MB on 3.13), so a run
    records their fingerprint (jaxtrain.data.record) and refuses to resume on other ones."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise DataError(f"data.source='stdlib' found no .py files under {root}")
    return files
