"""The shape of an input-format registry entry (formats.FORMATS)."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable


def _never(*_) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class InputFormat:
    """One input format: how `--format=auto` recognises a path as one (`claims`; the
    `fallback` format takes what none claims), how an input is cut into units of work
    (`units(i, item, options, unit_bytes, lo, hi)`: the units holding the records that start
    in its bytes [lo, hi)) and how a unit is read (`read(unit, i, item, options, tally,
    docs)`). `whole_files(options)`: each file is one document, and consecutive small files
    are grouped into a unit instead of being cut. `binary_checked`: files whose start is not
    text are left out (`--include-binary` keeps them)."""

    name: str
    units: Callable
    read: Callable
    claims: Callable[[pathlib.Path], bool] = _never
    package: str | None = None  # what it is read with (pip install 'jaxtrain[data]')
    whole_files: Callable = _never
    binary_checked: bool = False
    lines: bool = False  # its records are lines: reports number them by line
    fallback: bool = False
