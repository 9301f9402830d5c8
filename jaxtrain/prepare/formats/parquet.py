"""Parquet (.parquet): the `--field` column, cut into units by row groups."""

from __future__ import annotations

import pathlib

from jaxtrain.errors import DataError
from jaxtrain.prepare import records
from jaxtrain.prepare.formats.base import InputFormat
from jaxtrain.prepare.records import Unit

_FILES: dict = {}


def _claims(path: pathlib.Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return not path.is_dir() and bool(suffixes) and suffixes[-1] == ".parquet"


def _file(path: str):
    """The file, opened once per process."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"input {path}: Parquet needs pyarrow: pip install "
                        "'jaxtrain[data]'") from None
    if path not in _FILES:
        try:
            _FILES[path] = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common base
            raise DataError(f"input {path}: not a readable Parquet file ({e})") from None
    return _FILES[path]


def _units(i, item, options, unit_bytes, lo, hi) -> list[Unit]:
    """Row groups in units of about unit_bytes; a group lies at its share of the file's
    bytes (by the groups' uncompressed sizes)."""
    meta = _file(item.path).metadata
    sizes = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
    total, before, owned = sum(sizes), 0, []
    for g, size in enumerate(sizes):
        # group g lies at byte before * item.size / total; compared without division
        place = before * item.size
        if lo * max(total, 1) <= place < hi * max(total, 1):
            owned.append(g)
        before += size
    units, start, size = [], None, 0
    for g in owned:
        start = g if start is None else start
        size += sizes[g]
        if size >= unit_bytes or g == owned[-1]:
            units.append(Unit(i, i + 1, start, g + 1, size=size))
            start, size = None, 0
    return units


def _read(unit, i, item, options, tally, docs) -> None:
    pf = _file(item.path)
    names = pf.schema_arrow.names
    if options.chat is not None:
        return _read_chat(unit, i, item, pf, tally, docs, options)
    if options.field not in names:
        raise DataError(f"input {item.path}: no column {options.field!r} (--field); its "
                        f"columns are {', '.join(names)}")
    meta = pf.metadata
    groups = list(range(unit.start, unit.stop if unit.stop >= 0 else meta.num_row_groups))
    row = sum(meta.row_group(g).num_rows for g in range(unit.start))
    for g in groups:
        values = pf.read_row_group(g, columns=[options.field]).column(0).to_pylist()
        for value in values:
            row += 1
            tally.records += 1
            text = records.field_value(value, tally, (i, "row", row))
            if text is not None:
                records.keep(text, docs, tally, (i, "row", row))


def _read_chat(unit, i, item, pf, tally, docs, options) -> None:
    columns = records.chat_columns(pf.schema_arrow.names, item.path, options.chat)
    meta = pf.metadata
    row = sum(meta.row_group(g).num_rows for g in range(unit.start))
    for g in range(unit.start, unit.stop if unit.stop >= 0 else meta.num_row_groups):
        for record in pf.read_row_group(g, columns=columns).to_pylist():
            row += 1
            tally.records += 1
            records.keep_record(record, docs, tally, (i, "row", row))


FORMAT = InputFormat("parquet", units=_units, read=_read, claims=_claims, package="pyarrow")
