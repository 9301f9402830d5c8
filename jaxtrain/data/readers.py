"""Input documents for `prepare`: text files, JSON Lines, Parquet, Hugging Face datasets.

The inputs are cut into *units* of about `unit_bytes` each (consecutive small files grouped,
large line-based files split by byte range, Parquet by row groups, saved HF datasets by
rows). A unit is the grain of parallel work and of resumption, and the cut depends only on
the inputs and `unit_bytes`, never on how many processes read them, so the tokens come out
the same however the work is spread.

Bad input never stops a unit: malformed JSON lines, rows without the field, fields that are
not text and empty documents are skipped and counted, invalid UTF-8 is replaced (U+FFFD) and
counted; the first few of each, with file and line, go into the report.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import pathlib
from collections.abc import Iterator

from jaxtrain.errors import DataError, require_package

FORMATS = ("text", "jsonl", "parquet", "hf")
# The package each input format is read with (text and JSON Lines need none); hf-stream is
# a dataset --hf-dataset streams with datasets.load_dataset.
FORMAT_PACKAGES = {"parquet": "pyarrow", "hf": "datasets", "hf-stream": "datasets"}
TEXT_UNITS = ("file", "line")
SKIPS = ("malformed_json", "missing_field", "not_text", "empty")
BAD = ("malformed_json", "missing_field", "not_text")  # what --max-bad-fraction counts
FIRST_KEPT = 5  # locations kept per kind of bad input
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclasses.dataclass(frozen=True)
class Input:
    path: str
    format: str
    size: int


@dataclasses.dataclass
class Options:
    """How documents are read from the inputs."""

    field: str = "text"
    text_unit: str = "file"
    split: str = "train"  # of a saved DatasetDict


@dataclasses.dataclass(frozen=True)
class Unit:
    """inputs[first:last], or the part [start, stop) of inputs[first] (bytes for line-based
    files, row groups for Parquet, rows for datasets; stop -1: to the end)."""

    first: int
    last: int
    start: int = 0
    stop: int = -1
    size: int = 0


def _format_of(path: pathlib.Path, forced: str) -> str:
    if forced != "auto":
        return forced
    if path.is_dir():
        return "hf"
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    if suffixes and suffixes[-1] in _JSONL_SUFFIXES:
        return "jsonl"
    if suffixes and suffixes[-1] == ".parquet":
        return "parquet"
    return "text"


def is_hf_saved(path: pathlib.Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _HF_MARKERS)


def find_inputs(patterns: list[str], fmt: str = "auto") -> list[Input]:
    """Files named by paths, directories (every file below, sorted) and globs (`**`
    recursive), in the order given; a saved Hugging Face dataset directory is one input."""
    if fmt not in ("auto",) + FORMATS:
        raise DataError(f"--format={fmt} is invalid: valid values are auto, {', '.join(FORMATS)}")
    found, seen = [], set()
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = sorted(glob.glob(expanded, recursive=True))
        elif os.path.isdir(expanded) and not is_hf_saved(pathlib.Path(expanded)):
            matches = sorted(str(p) for p in pathlib.Path(expanded).rglob("*") if p.is_file())
        else:
            matches = [expanded]
        matches = [m for m in matches if not (os.path.isdir(m) and not is_hf_saved(
            pathlib.Path(m)))]
        if not matches:
            raise DataError(f"input {pattern}: no such file, or no file matches it")
        for match in matches:
            path = pathlib.Path(match)
            if not path.exists():
                raise DataError(f"input {match}: no such file or directory")
            if match in seen:
                continue
            seen.add(match)
            size = (sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
                    if path.is_dir() else path.stat().st_size)
            found.append(Input(match, _format_of(path, fmt), size))
    return found


def require_packages(inputs: list[Input]) -> None:
    """DataError (one line) for the first input whose format's package is missing, before
    anything is read or written."""
    for item in inputs:
        module = FORMAT_PACKAGES.get(item.format)
        if module is not None:
            what = (f"--hf-dataset={item.path}" if item.format == "hf-stream"
                    else f"input {item.path} ({item.format})")
            require_package(module, what, error=DataError)


def plan_units(inputs: list[Input], options: Options, unit_bytes: int) -> list[Unit]:
    """Cuts the inputs into units of about unit_bytes (see the module docstring)."""
    units: list[Unit] = []
    group_start, group_size = None, 0

    def close_group(end: int) -> None:
        nonlocal group_start, group_size
        if group_start is not None:
            units.append(Unit(group_start, end, size=group_size))
        group_start, group_size = None, 0

    for i, item in enumerate(inputs):
        if item.format == "text" and options.text_unit == "file":
            if group_start is None:
                group_start = i
            group_size += item.size
            if group_size >= unit_bytes:
                close_group(i + 1)
            continue
        close_group(i)
        units.extend(_split(i, item, options, unit_bytes))
    close_group(len(inputs))
    return units


def _split(i: int, item: Input, options: Options, unit_bytes: int) -> list[Unit]:
    if item.format == "parquet":
        return _parquet_units(i, item, unit_bytes)
    if item.format == "hf":
        rows = len(_open_hf(item.path, options.split))
        per = max(1, int(rows * unit_bytes / max(item.size, 1)))
        return [Unit(i, i + 1, a, min(a + per, rows), size=item.size * (min(a + per, rows) - a)
                     // max(rows, 1)) for a in range(0, rows, per)] or [Unit(i, i + 1, 0, 0)]
    if item.path.endswith(".gz") or item.size <= unit_bytes:
        return [Unit(i, i + 1, 0, -1, size=item.size)]
    return [Unit(i, i + 1, a, min(a + unit_bytes, item.size), size=min(unit_bytes, item.size - a))
            for a in range(0, item.size, unit_bytes)]


def _parquet_units(i: int, item: Input, unit_bytes: int) -> list[Unit]:
    meta = _parquet_file(item.path).metadata
    units, start, size = [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= unit_bytes or g == meta.num_row_groups - 1:
            units.append(Unit(i, i + 1, start, g + 1, size=size))
            start, size = g + 1, 0
    return units or [Unit(i, i + 1, 0, 0)]


# --- reading -------------------------------------------------------------------------------

@dataclasses.dataclass
class Tally:
    """Counts of one stretch of input; bad and replaced records with their first locations.
    A location is (input index, 'line'|'row'|'file', number); line numbers are relative to
    the unit until `prepare` adds the lines of the units before."""

    records: int = 0
    documents: int = 0
    text_bytes: int = 0
    lines: int = 0  # lines read (line-based units), to number the lines of the next unit
    counts: dict = dataclasses.field(default_factory=dict)
    first: dict = dataclasses.field(default_factory=dict)

    def note(self, kind: str, where: tuple) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        kept = self.first.setdefault(kind, [])
        if len(kept) < FIRST_KEPT:
            kept.append(where)

    def bad(self) -> int:
        return sum(self.counts.get(k, 0) for k in BAD)


def read_unit(unit: Unit, inputs: list[Input], options: Options, tally: Tally) -> list[str]:
    """The documents of a unit, in order; skipped and replaced input is counted in tally."""
    docs: list[str] = []
    for i in range(unit.first, unit.last):
        item = inputs[i]
        if item.format == "text" and options.text_unit == "file":
            text = _decode(_read_bytes(item.path), tally, (i, "file", 0))
            tally.records += 1
            _keep(text, docs, tally, (i, "file", 0))
        elif item.format in ("text", "jsonl"):
            _read_lines(unit, i, item, options, tally, docs)
        elif item.format == "parquet":
            _read_parquet(unit, i, item, options, tally, docs)
        else:
            _read_hf(unit, i, item, options, tally, docs)
    return docs


def _keep(text: str, docs: list[str], tally: Tally, where: tuple) -> None:
    if not text:
        tally.note("empty", where)
        return
    docs.append(text)
    tally.documents += 1


def _decode(data: bytes, tally: Tally, where: tuple) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        tally.note("invalid_utf8", where)
        return data.decode("utf-8", errors="replace")


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    return gzip.decompress(data) if path.endswith(".gz") else data


def _lines(unit: Unit, path: str) -> Iterator[bytes]:
    """The lines that start in [unit.start, unit.stop): a line belongs to the unit where it
    starts, so byte ranges cut anywhere still give every line to exactly one unit."""
    if path.endswith(".gz"):
        yield from io.BytesIO(_read_bytes(path))
        return
    with open(path, "rb") as f:
        position = unit.start
        if position > 0:
            f.seek(position - 1)
            if f.read(1) != b"\n":
                position += len(f.readline())  # the rest of a line the unit before owns
        stop = unit.stop if unit.stop >= 0 else float("inf")
        while position < stop:
            line = f.readline()
            if not line:
                return
            position += len(line)
            yield line


def _read_lines(unit: Unit, i: int, item: Input, options: Options, tally: Tally,
                docs: list[str]) -> None:
    for number, raw in enumerate(_lines(unit, item.path), start=1):
        tally.lines = number
        where = (i, "line", number)
        line = raw.rstrip(b"\r\n")
        if item.format == "text":
            tally.records += 1
            _keep(_decode(line, tally, where), docs, tally, where)
            continue
        if not line.strip():
            continue
        tally.records += 1
        text = _json_field(_decode(line, tally, where), options.field, tally, where)
        if text is not None:
            _keep(text, docs, tally, where)


def _json_field(line: str, field: str, tally: Tally, where: tuple) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        tally.note("malformed_json", where)
        return None
    if not isinstance(record, dict) or record.get(field) is None:
        tally.note("missing_field", where)
        return None
    value = record[field]
    if not isinstance(value, str):
        tally.note("not_text", where)
        return None
    return value


def _field_value(value, tally: Tally, where: tuple) -> str | None:
    if value is None:
        tally.note("missing_field", where)
        return None
    if isinstance(value, bytes):
        return _decode(value, tally, where)
    if not isinstance(value, str):
        tally.note("not_text", where)
        return None
    return value


_PARQUET_FILES: dict = {}


def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"input {path}: Parquet needs pyarrow: pip install "
                        "'jaxtrain[data]'") from None
    if path not in _PARQUET_FILES:
        try:
            _PARQUET_FILES[path] = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common base
            raise DataError(f"input {path}: not a readable Parquet file ({e})") from None
    return _PARQUET_FILES[path]


def _read_parquet(unit: Unit, i: int, item: Input, options: Options, tally: Tally,
                  docs: list[str]) -> None:
    pf = _parquet_file(item.path)
    names = pf.schema_arrow.names
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
            text = _field_value(value, tally, (i, "row", row))
            if text is not None:
                _keep(text, docs, tally, (i, "row", row))


_HF_DATASETS: dict = {}


def _open_hf(path: str, split: str):
    """A dataset saved with save_to_disk (memory-mapped Arrow), opened once per process."""
    key = (path, split)
    if key not in _HF_DATASETS:
        try:
            import datasets
        except ImportError:
            raise DataError(f"input {path}: Hugging Face datasets need the datasets package: "
                            "pip install 'jaxtrain[data]'") from None
        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"input {path}: no split {split!r} (--split); it has "
                                f"{', '.join(loaded)}")
            loaded = loaded[split]
        _HF_DATASETS[key] = loaded
    return _HF_DATASETS[key]


def _read_hf(unit: Unit, i: int, item: Input, options: Options, tally: Tally,
             docs: list[str]) -> None:
    ds = _open_hf(item.path, options.split)
    if options.field not in ds.column_names:
        raise DataError(f"input {item.path}: no column {options.field!r} (--field); its "
                        f"columns are {', '.join(ds.column_names)}")
    values = ds[unit.start:unit.stop][options.field]
    for row, value in enumerate(values, start=unit.start + 1):
        tally.records += 1
        text = _field_value(value, tally, (i, "row", row))
        if text is not None:
            _keep(text, docs, tally, (i, "row", row))


def read_stream_rows(rows, field: str, first_row: int, tally: Tally) -> list[str]:
    """Documents from rows of a streamed dataset (input 0), counted like the others."""
    docs: list[str] = []
    for row, record in enumerate(rows, start=first_row + 1):
        tally.records += 1
        where = (0, "row", row)
        value = record.get(field) if isinstance(record, dict) else None
        text = _field_value(value, tally, where)
        if text is not None:
            _keep(text, docs, tally, where)
    return docs
