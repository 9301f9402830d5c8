"""JSON Lines (.jsonl, .ndjson, .json, optionally .gz): one document per line, its text in
`--field`; malformed lines and records without a text field are counted, not fatal."""

from __future__ import annotations

import json
import pathlib

from jaxtrain.prepare import records
from jaxtrain.prepare.formats.base import InputFormat

SUFFIXES = (".jsonl", ".ndjson", ".json")


def _claims(path: pathlib.Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return not path.is_dir() and bool(suffixes) and suffixes[-1] in SUFFIXES


def _json_field(line: str, field: str, tally, where: tuple) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        tally.note("malformed_json", where)
        return None
    if not isinstance(record, dict) or record.get(field) is None:
        records.missing(record, field, tally, where)
        return None
    value = record[field]
    if not isinstance(value, str):
        tally.note("not_text", where)
        return None
    return records.encodable(value, tally, where)


def _json_record(line: str, tally, where: tuple, docs: list) -> None:
    try:
        record = json.loads(line)
    except ValueError:
        tally.note("malformed_json", where)
        return
    records.keep_record(record, docs, tally, where)


def _read(unit, i, item, options, tally, docs) -> None:
    for where, line in records.numbered_lines(unit, i, item, tally):
        if not line.strip():
            continue
        tally.records += 1
        if options.chat is not None:
            _json_record(records.decode(line, tally, where), tally, where, docs)
            continue
        text = _json_field(records.decode(line, tally, where), options.field, tally, where)
        if text is not None:
            records.keep(text, docs, tally, where)


def _units(i, item, options, unit_bytes, lo, hi):
    return records.byte_range_units(i, item, unit_bytes, lo, hi)


FORMAT = InputFormat("jsonl", units=_units, read=_read, claims=_claims, lines=True)
