"""Text files: one document per file (`--text-unit=file`, the default) or per line."""

from __future__ import annotations

from jaxtrain.prepare import records
from jaxtrain.prepare.formats.base import InputFormat


def _read(unit, i, item, options, tally, docs) -> None:
    if options.text_unit == "file":
        where = (i, "file", 0)
        text = records.decode(records.read_bytes(item.path), tally, where)
        tally.records += 1
        records.keep(text, docs, tally, where)
        return
    for where, line in records.numbered_lines(unit, i, item, tally):
        tally.records += 1
        records.keep(records.decode(line, tally, where), docs, tally, where)


def _units(i, item, options, unit_bytes, lo, hi):
    return records.byte_range_units(i, item, unit_bytes, lo, hi)


FORMAT = InputFormat("text", units=_units, read=_read,
                     whole_files=lambda options: options.text_unit == "file",
                     binary_checked=True, lines=True, fallback=True)
