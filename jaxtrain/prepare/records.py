"""What every input format shares: an input, how it is read (Options), the units it is cut
into, the Tally of one stretch of input, and the per-record checks (empty documents, invalid
UTF-8 and lone surrogates, missing or non-text fields) that count bad input instead of
stopping on it."""

from __future__ import annotations

import dataclasses
import gzip
import io
import re
from collections.abc import Iterator

from jaxtrain.errors import DataError
from jaxtrain.prepare import chat

TEXT_UNITS = ("file", "line")
FILE_SKIPS = ("hidden_files", "binary_files")  # input files left out, with example paths
SKIPS = ("malformed_json", "missing_field", "not_text", "empty") + FILE_SKIPS
# --chat's kinds (chat.BAD): in a report only when counted, so that the reports of other
# prepares read as before.
CHAT_SKIPS = chat.BAD
# what --max-bad-fraction counts
BAD = ("malformed_json", "missing_field", "not_text") + CHAT_SKIPS
FIRST_KEPT = 5  # locations kept per kind of bad input
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
    text_unit: str = "file"  # text files: one document per file or per line (TEXT_UNITS)
    split: str = "train"  # of a saved DatasetDict
    # --chat: records are conversations, rendered with a chat template (chat.ChatSpec); the
    # readers then hand on whole records rather than the text of `field`
    chat: chat.ChatSpec | None = None


@dataclasses.dataclass(frozen=True)
class Unit:
    """inputs[first:last], or the part [start, stop) of inputs[first] (bytes for line-based
    files, row groups for Parquet, rows for datasets; stop -1: to the end)."""

    first: int
    last: int
    start: int = 0
    stop: int = -1
    size: int = 0


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


def keep(text: str, docs: list[str], tally: Tally, where: tuple) -> None:
    if not text:
        tally.note("empty", where)
        return
    docs.append(text)
    tally.documents += 1


CHAT_COLUMNS = ("messages", "prompt", "completion")
PREFERENCE_COLUMNS = ("messages", "prompt", "chosen", "rejected")


def chat_columns(names, path: str, spec: chat.ChatSpec | None = None) -> list[str]:
    """The columns a --chat (or --preference: spec.preference) prepare reads from a table;
    DataError when it has none."""
    if spec is not None and spec.preference:
        columns = [c for c in PREFERENCE_COLUMNS if c in names]
        if not {"chosen", "rejected"} <= set(columns) or not {"messages", "prompt"} & set(
                columns):
            raise DataError(f"input {path}: --preference needs columns chosen and rejected, "
                            f"with prompt or messages; its columns are {', '.join(names)}")
        return columns
    columns = [c for c in CHAT_COLUMNS if c in names]
    if "messages" not in columns and not {"prompt", "completion"} <= set(columns):
        raise DataError(f"input {path}: --chat needs a column messages, or prompt and "
                        f"completion; its columns are {', '.join(names)}")
    return columns


def keep_record(record, docs: list, tally: Tally, where: tuple) -> None:
    """A chat record with its location: the worker renders it, and counts it a document or
    a bad record (chat.encode)."""
    docs.append((record, where))


def encodable(text: str, tally: Tally, where: tuple) -> str:
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


def decode(data: bytes, tally: Tally, where: tuple) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        tally.note("invalid_utf8", where)
        return data.decode("utf-8", errors="replace")


def missing(record, field: str, tally: Tally, where: tuple) -> None:
    tally.note("missing_field", where)
    if tally.fields is None and isinstance(record, dict) and field not in record:
        tally.fields = [str(key) for key in record]


def field_value(value, tally: Tally, where: tuple) -> str | None:
    if value is None:
        tally.note("missing_field", where)
        return None
    if isinstance(value, bytes):
        return decode(value, tally, where)
    if not isinstance(value, str):
        tally.note("not_text", where)
        return None
    return encodable(value, tally, where)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    return gzip.decompress(data) if path.endswith(".gz") else data


def byte_range_units(i: int, item: Input, unit_bytes: int, lo: int, hi: int) -> list[Unit]:
    """Units of about unit_bytes of a line-based file, holding the lines that start in its
    bytes [lo, hi); a .gz file is one unit (no seeking into a compressed file)."""
    if item.path.endswith(".gz"):
        return [Unit(i, i + 1, 0, -1, size=item.size)] if lo <= 0 < hi else []
    start, stop = max(lo, 0), min(hi, item.size)
    if start >= stop:
        return []
    return [Unit(i, i + 1, a, min(a + unit_bytes, stop), size=min(unit_bytes, stop - a))
            for a in range(start, stop, unit_bytes)]


def lines(unit: Unit, path: str) -> Iterator[bytes]:
    """The lines that start in [unit.start, unit.stop): a line belongs to the unit where it
    starts, so byte ranges cut anywhere still give every line to exactly one unit."""
    if path.endswith(".gz"):
        yield from io.BytesIO(read_bytes(path))
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


def numbered_lines(unit: Unit, i: int, item: Input, tally: Tally) -> Iterator[tuple]:
    """(where, line without its end) for each line of the unit, counted in tally.lines."""
    for number, raw in enumerate(lines(unit, item.path), start=1):
        tally.lines = number
        yield (i, "line", number), raw.rstrip(b"\r\n")
