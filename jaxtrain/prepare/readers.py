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

import glob
import gzip
import os
import pathlib

from jaxtrain.errors import DataError, require_package
from jaxtrain.prepare import formats, records
from jaxtrain.prepare.formats import FORMATS, hf
from jaxtrain.prepare.records import FILE_SKIPS, FIRST_KEPT, Input, Options, Tally, Unit

# A text file is binary when its first HEAD_BYTES hold a NUL byte (git's test) or more than
# BINARY_INVALID of them are not UTF-8: "mostly", so that Latin-1 prose (a few % of its bytes)
# is kept and replaced, while random bytes, images and UTF-16 go. The built-in corpus passes
# whole: its most foreign file, a KOI8-R test module, is 42% not UTF-8.
HEAD_BYTES = 8192
BINARY_INVALID = 0.5


def discover(patterns: list[str], fmt: str = "auto", include_hidden: bool = False,
             include_binary: bool = False) -> tuple[list[Input], dict[str, list]]:
    """Files named by paths, directories (every file below, sorted, hidden ones left out) and
    globs (`**` recursive; Python's glob never matches hidden names), in the order given; a
    saved Hugging Face dataset directory is one input. Binary text files are left out too.
    Returns the inputs and, per kind of FILE_SKIPS, [count, first example paths]."""
    if fmt != "auto" and fmt not in FORMATS:
        raise DataError(f"--format={fmt} is invalid: valid values are auto, {', '.join(FORMATS)}")
    found, seen = [], set()
    skipped = {kind: [0, []] for kind in FILE_SKIPS}
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = sorted(glob.glob(expanded, recursive=True, include_hidden=include_hidden))
        elif os.path.isdir(expanded) and not hf.is_saved(pathlib.Path(expanded)):
            matches = _files_below(pathlib.Path(expanded), include_hidden, skipped)
        else:
            matches = [expanded]
        matches = [m for m in matches if not (os.path.isdir(m) and not hf.is_saved(
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
            item = Input(match, formats.format_of(path, fmt), size)
            if (FORMATS[item.format].binary_checked and not include_binary
                    and is_binary(_head(match))):
                _note_file(skipped, "binary_files", match)
                continue
            found.append(item)
    return found, skipped


def require_packages(inputs: list[Input]) -> None:
    """DataError (one line) for the first input whose format's package is missing, before
    anything is read or written."""
    for item in inputs:
        if (module := FORMATS[item.format].package) is not None:
            require_package(module, f"input {item.path} ({item.format})", error=DataError)


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
        fmt = FORMATS[item.format]
        if fmt.whole_files(options):  # one document a file: small files grouped
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
        units.extend(fmt.units(i, item, options, unit_bytes, lo, hi))
    close_group(len(inputs))
    return units


# --- reading -------------------------------------------------------------------------------

def read_unit(unit: Unit, inputs: list[Input], options: Options, tally: Tally) -> list[str]:
    """The documents of a unit, in order; skipped and replaced input is counted in tally."""
    docs: list[str] = []
    for i in range(unit.first, unit.last):
        item = inputs[i]
        FORMATS[item.format].read(unit, i, item, options, tally, docs)
    return docs


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


def read_stream_rows(rows, field: str, first_row: int, tally: Tally,
                     chat: bool = False) -> list:
    """Documents from rows of a streamed dataset (input 0), counted like the others (with
    `chat`, the rows themselves: records.keep_record)."""
    docs: list = []
    for row, record in enumerate(rows, start=first_row + 1):
        tally.records += 1
        where = (0, "row", row)
        if chat:
            records.keep_record(record, docs, tally, where)
            continue
        value = record.get(field) if isinstance(record, dict) else None
        if value is None:
            records.missing(record, field, tally, where)
            continue
        text = records.field_value(value, tally, where)
        if text is not None:
            records.keep(text, docs, tally, where)
    return docs
