"""Input documents for `prepare`: text files, JSON Lines, Parquet, Hugging Face datasets.

The inputs are cut into *units* of about `unit_bytes` each (consecutive small files grouped,
large line-based files split by byte range, Parquet by row groups, saved HF datasets by
rows). A unit is the grain of parallel work and of resumption, and the cut depends only on
the inputs and `unit_bytes`, never on how many processes read them, so the tokens come out
the same however the work is spread. A part of a multi-machine prepare (`--shard I/N`) takes
the records that start in its N-th of the inputs' bytes laid end to end (plan_units' span),
so every part has work even when one file holds most of the bytes.

Bad input never stops a unit: malformed JSON lines, rows without the field, fields that are
not text and empty documents are skipped and counted, invalid UTF-8 (and lone surrogates, which
JSON can spell but UTF-8 cannot) is replaced (U+FFFD) and counted; the first few of each, with
file and line, go into the report.

Directories are walked without their hidden files and directories (`.git/`, `.env`), and text
files that are binary (`is_binary`) are left out wherever they were named; both are counted
with a few example paths (`discover`), and `include_hidden` / `include_binary` take them.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import pathlib
import re
from collections.abc import Iterator

from jaxtrain.errors import DataError, require_package

FORMATS = ("text", "jsonl", "parquet", "hf")
# The package each input format is read with (text and JSON Lines need none); hf-stream is
# a dataset --hf-dataset streams with datasets.load_dataset.
FORMAT_PACKAGES = {"parquet": "pyarrow", "hf": "datasets", "hf-stream": "datasets"}
TEXT_UNITS = ("file", "line")
FILE_SKIPS = ("hidden_files", "binary_files")  # input files left out, with example paths
SKIPS = ("malformed_json", "missing_field", "not_text", "empty") + FILE_SKIPS
BAD = ("malformed_json", "missing_field", "not_text")  # what --max-bad-fraction counts
FIRST_KEPT = 5  # locations kept per kind of bad input
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# A text file is binary when its first HEAD_BYTES hold a NUL byte (git's test) or more than
# BINARY_INVALID of them are not UTF-8: "mostly", so that Latin-1 prose (a few % of its bytes)
# is kept and replaced, while random bytes, images and UTF-16 go. The built-in corpus passes
# whole: its most foreign file, a KOI8-R test module, is 42% not UTF-8.
HEAD_BYTES = 8192
BINARY_INVALID = 0.5
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def discover(patterns: list[str], fmt: str = "auto", include_hidden: bool = False,
             include_binary: bool = False) -> tuple[list[Input], dict[str, list]]:
    """Files named by paths, directories (every file below, sorted, hidden ones left out) and
    globs (`**` recursive; Python's glob never matches hidden names), in the order given; a
    saved Hugging Face dataset directory is one input. Binary text files are left out too.
    Returns the inputs and, per kind of FILE_SKIPS, [count, first example paths]."""
    if fmt not in ("auto",) + FORMATS:
        raise DataError(f"--format={fmt} is invalid: valid values are auto, {', '.join(FORMATS)}")
    found, seen = [], set()
    skipped = {kind: [0, []] for kind in FILE_SKIPS}
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = sorted(glob.glob(expanded, recursive=True, include_hidden=include_hidden))
        elif os.path.isdir(expanded) and not is_hf_saved(pathlib.Path(expanded)):
            matches = _files_below(pathlib.Path(expanded), include_hidden, skipped)
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
            item = Input(match, _format_of(path, fmt), size)
            if item.format == "text" and not include_binary and is_binary(_head(match)):
                _note_file(skipped, "binary_files", match)
                continue
            found.append(item)
    return found, skipped


def require_packages(inputs: list[Input]) -> None:
    """DataError (one line) for the first input whose format's package is missing, before
    anything is read or written."""
    for item in inputs:
        module = FORMAT_PACKAGES.get(item.format)
        if module is not None:
            what = (f"--hf-dataset={item.path}" if item.format == "hf-stream"
                    else f"input {item.path} ({item.format})")
            require_package(module, what, error=DataError)


def _note_file(skipped: dict, kind: str, example: str) -> None:
    skipped[kind][0] += 1
    if example not in skipped[kind][1] and len(skipped[kind][1]) < FIRST_KEPT:
        skipped[kind][1].append(example)


def _files_below(directory: pathlib.Path, include_hidden: bool, skipped: dict) -> list[str]:
    """Every file below `directory`, sorted; those under a hidden name (relative to it) are
    counted instead, each shown by its outermost hidden path (`repo/.git/`)."""
    files = sorted(str(p) for p in directory.rglob("*") if p.is_file())
    if include_hidden:
        return files
    kept = []
    for file in files:
        parts = pathlib.Path(file).relative_to(directory).parts
        hidden = next((k for k, part in enumerate(parts) if part.startswith(".")), None)
        if hidden is None:
            kept.append(file)
        else:
            outer = str(directory.joinpath(*parts[:hidden + 1]))
            _note_file(skipped, "hidden_files", outer + ("/" if hidden < len(parts) - 1 else ""))
    return kept


def _head(path: str) -> bytes:
    """The first HEAD_BYTES of a file (decompressed for .gz); b"" when it cannot be read, so
    that reading it later reports the problem as before."""
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            return f.read(HEAD_BYTES)
    except (OSError, EOFError):
        return b""


def is_binary(head: bytes) -> bool:
    """Whether the start of a file is binary rather than text (see BINARY_INVALID)."""
    if b"\0" in head:
        return True
    valid = len(head.decode("utf-8", errors="ignore").encode("utf-8"))
    return len(head) - valid > BINARY_INVALID * len(head)


def part_span(inputs: list[Input], i: int, n: int) -> tuple[int, int]:
    """Part i of n of the inputs' bytes laid end to end: [lo, hi), the last part to the end
    (its hi past the end, so that empty files at the end belong to it)."""
    total = sum(item.size for item in inputs)
    return i * total // n, (i + 1) * total // n if i < n - 1 else total + 1


def plan_units(inputs: list[Input], options: Options, unit_bytes: int,
               span: tuple[int, int] | None = None) -> list[Unit]:
    """Cuts the inputs into units of about unit_bytes (see the module docstring). With a
    span (a part of `prepare --shard`, part_span), only the records whose first byte lies in
    span of the inputs laid end to end: line-based files are cut at the span's bytes (a
    line belongs where it starts), Parquet row groups and dataset rows are placed at their
    share of the file's bytes, and a record that is a whole file (a text document, a .gz
    file) lies at the file's first byte."""
    units: list[Unit] = []
    group_start, group_size = None, 0

    def close_group(end: int) -> None:
        nonlocal group_start, group_size
        if group_start is not None:
            units.append(Unit(group_start, end, size=group_size))
        group_start, group_size = None, 0

    offset = 0
    for i, item in enumerate(inputs):
        lo, hi = (0, item.size + 1) if span is None else (span[0] - offset, span[1] - offset)
        offset += item.size
        if item.format == "text" and options.text_unit == "file":  # one document a file
            if not lo <= 0 < hi:
                close_group(i)
                continue
            if group_start is None:
                group_start = i
            group_size += item.size
            if group_size >= unit_bytes:
                close_group(i + 1)
            continue
        close_group(i)
        units.extend(_split(i, item, options, unit_bytes, lo, hi))
    close_group(len(inputs))
    return units


def _split(i: int, item: Input, options: Options, unit_bytes: int, lo: int,
           hi: int) -> list[Unit]:
    """The units of input i holding the records that start in its bytes [lo, hi)."""
    if item.format == "parquet":
        return _parquet_units(i, item, unit_bytes, lo, hi)
    if item.format == "hf":
        rows = len(_open_hf(item.path, options.split))
        first, last = (_scaled(lo, rows, item.size), _scaled(hi, rows, item.size))
        per = max(1, int(rows * unit_bytes / max(item.size, 1)))
        return [Unit(i, i + 1, a, min(a + per, last), size=item.size * (min(a + per, last) - a)
                     // max(rows, 1)) for a in range(first, last, per)]
    if item.path.endswith(".gz"):  # no seeking into a compressed file: read whole
        return [Unit(i, i + 1, 0, -1, size=item.size)] if lo <= 0 < hi else []
    start, stop = max(lo, 0), min(hi, item.size)
    if start >= stop:
        return []
    return [Unit(i, i + 1, a, min(a + unit_bytes, stop), size=min(unit_bytes, stop - a))
            for a in range(start, stop, unit_bytes)]


def _scaled(position: int, count: int, size: int) -> int:
    """The first of `count` items spread evenly over `size` bytes (item k at byte
    k * size / count) at or after byte `position`, clamped to [0, count]."""
    if position <= 0:
        return 0
    if size == 0:
        return count
    return min(-(-position * count // size), count)


def _parquet_units(i: int, item: Input, unit_bytes: int, lo: int, hi: int) -> list[Unit]:
    """Row groups in units of about unit_bytes; a group lies at its share of the file's
    bytes (by the groups' uncompressed sizes)."""
    meta = _parquet_file(item.path).metadata
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
    fields: list | None = None  # the keys of the first record without the field (a hint)
    replaced_at: tuple | None = None  # the last record replaced: counted once, not per cause

    def note(self, kind: str, where: tuple) -> None:
        if kind == "invalid_utf8":
            if where == self.replaced_at:
                return
            self.replaced_at = where
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


def _encodable(text: str, tally: Tally, where: tuple) -> str:
    """Text without lone surrogates: JSON spells them ("\\ud800", common in scraped data)
    but UTF-8 and every tokenizer refuse them, so they are replaced and counted like invalid
    UTF-8."""
    if text.isascii():  # O(1) in CPython: most text costs nothing here
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        tally.note("invalid_utf8", where)
        return _SURROGATE.sub("\ufffd", text)
    return text


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


def lines_before(path: str, start: int) -> int:
    """The lines of a file before the first line that starts at or after byte `start` (a
    part of `prepare --shard` starting inside the file numbers its lines from there)."""
    count = 0
    with open(path, "rb") as f:
        for done in range(0, start, 1 << 24):
            count += f.read(min(1 << 24, start - done)).count(b"\n")
        if start > 0:
            f.seek(start - 1)
            count += f.read(1) not in (b"\n", b"")  # the line running across `start`
    return count


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
        _missing(record, field, tally, where)
        return None
    value = record[field]
    if not isinstance(value, str):
        tally.note("not_text", where)
        return None
    return _encodable(value, tally, where)


def _missing(record, field: str, tally: Tally, where: tuple) -> None:
    tally.note("missing_field", where)
    if tally.fields is None and isinstance(record, dict) and field not in record:
        tally.fields = [str(key) for key in record]


def _field_value(value, tally: Tally, where: tuple) -> str | None:
    if value is None:
        tally.note("missing_field", where)
        return None
    if isinstance(value, bytes):
        return _decode(value, tally, where)
    if not isinstance(value, str):
        tally.note("not_text", where)
        return None
    return _encodable(value, tally, where)


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
        if value is None:
            _missing(record, field, tally, where)
            continue
        text = _field_value(value, tally, where)
        if text is not None:
            _keep(text, docs, tally, where)
    return docs
