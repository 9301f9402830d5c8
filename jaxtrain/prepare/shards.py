"""The staged shards of a prepare (jaxtrain.prepare.pipeline): a unit's tokenized result, the
counts over all units with where bad input was first seen, and the writer that commits a
shard by renaming its tokens, then its index, then writing the record that marks it done
(so that a rerun keeps exactly the shards whose record exists)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import numpy as np

from jaxtrain import storage
from jaxtrain.data import dataset as fmt
from jaxtrain.data import fingerprints
from jaxtrain.prepare import readers, records


@dataclasses.dataclass
class UnitResult:
    tokens: np.ndarray
    lengths: np.ndarray  # tokens of each kept document, in order
    tally: records.Tally
    size: int  # input bytes, for the progress bar
    # fingerprints.stream_hash of the tokens and of the lengths (and of the mask), computed
    # in the worker
    stream: dict = dataclasses.field(default_factory=dict)
    mask: np.ndarray | None = None  # uint8 per token, 1: a counted target (--chat only)


REPLACED_WARNING = 0.01  # of the records: above it, a prepare warns about replaced UTF-8


class Report:
    """Counts over the whole prepare, with the first locations of each kind of bad input as
    'path:line' / 'path row N' / 'path'."""

    def __init__(self, inputs: list[records.Input], starts: dict[int, int] | None = None,
                 skipped_files: dict | None = None):
        self.inputs = inputs
        # line-based inputs read from a byte inside them (a part of a `--shard` prepare), by
        # index: their lines before it are counted when a location in them is first shown
        self.starts = dict(starts or {})
        self.skipped_lines: dict[int, int] = {}
        self.totals = {"records": 0, "documents": 0, "tokens": 0, "text_bytes": 0}
        self.counts: dict[str, int] = {}
        self.first: dict[str, list[str]] = {}
        self.lines_before: dict[int, int] = {}  # lines of each line-based input already read
        self.fields: list[str] | None = None  # of the first record without the field
        for kind, (count, examples) in (skipped_files or {}).items():  # readers.discover's
            if count:
                self.counts[kind], self.first[kind] = count, list(examples)

    def add(self, unit_first: int, result: UnitResult) -> None:
        tally = result.tally
        self.totals["records"] += tally.records
        self.totals["documents"] += tally.documents
        self.totals["text_bytes"] += tally.text_bytes
        self.totals["tokens"] += len(result.tokens)
        for kind, count in tally.counts.items():
            self.counts[kind] = self.counts.get(kind, 0) + count
            kept = self.first.setdefault(kind, [])
            for where in tally.first[kind]:
                if len(kept) < records.FIRST_KEPT:
                    kept.append(self._where(where))
        if tally.lines:
            self.lines_before[unit_first] = self.lines_before.get(unit_first, 0) + tally.lines
        if self.fields is None:
            self.fields = tally.fields

    def _where(self, where: tuple) -> str:
        index, kind, number = where
        path = self.inputs[index].path
        if kind == "line":
            if index in self.starts and index not in self.skipped_lines:
                self.skipped_lines[index] = readers.lines_before(path, self.starts[index])
            before = self.skipped_lines.get(index, 0) + self.lines_before.get(index, 0)
            return f"{path}:{before + number}"
        return f"{path} row {number}" if kind == "row" else path

    def bad(self) -> int:
        return sum(self.counts.get(k, 0) for k in records.BAD)

    def to_json(self) -> dict:
        kinds = records.SKIPS + tuple(k for k in records.CHAT_SKIPS if self.counts.get(k))
        skipped = {k: {"count": self.counts.get(k, 0), "first": self.first.get(k, [])}
                   for k in kinds}
        if self.fields is not None:
            skipped["missing_field"]["fields"] = self.fields
        return {**self.totals, "skipped": skipped,
                "invalid_utf8_replaced": {"count": self.counts.get("invalid_utf8", 0),
                                          "first": self.first.get("invalid_utf8", [])}}

    @classmethod
    def from_json(cls, inputs, data: dict, lines_before: dict, starts=None) -> Report:
        report = cls(inputs, starts)
        report.totals = {k: data[k] for k in report.totals}
        for kind, value in [*data["skipped"].items(),
                            ("invalid_utf8", data["invalid_utf8_replaced"])]:
            if value["count"]:
                report.counts[kind] = value["count"]
                report.first[kind] = list(value["first"])
        report.lines_before = {int(k): v for k, v in lines_before.items()}
        report.fields = data["skipped"]["missing_field"].get("fields")
        return report

    def summary(self) -> str:
        parts = [f"{self.totals['documents']:,} documents, {self.totals['tokens']:,} tokens"]
        for kind in records.SKIPS + records.CHAT_SKIPS:
            if self.counts.get(kind):
                shown = 3 if kind in records.FILE_SKIPS else 1  # files: what was left out
                parts.append(f"skipped {self.counts[kind]:,} {kind.replace('_', ' ')} "
                             f"(first: {', '.join(self.first[kind][:shown])})")
        if self.counts.get("invalid_utf8"):
            parts.append(f"replaced invalid UTF-8 in {self.counts['invalid_utf8']:,} records "
                         f"(first: {self.first['invalid_utf8'][0]})")
        return "; ".join(parts)

    def field_hint(self, field: str) -> str | None:
        """What to do when records lack the text field: the fields the first one has."""
        if self.fields is None or not self.counts.get("missing_field"):
            return None
        where = self.first["missing_field"][0]
        fields = ", ".join(self.fields[:10]) + (", ..." if len(self.fields) > 10 else "")
        return (f"the first record without field {field!r} ({where}) has fields "
                f"{fields or '(none)'}: name the text field with --field NAME")

    def replaced_warning(self) -> str | None:
        """A line when more than REPLACED_WARNING of the records needed UTF-8 replaced: the
        input is probably in another encoding, and its text is being lost."""
        records, replaced = self.totals["records"], self.counts.get("invalid_utf8", 0)
        if not records or replaced <= REPLACED_WARNING * records:
            return None
        return (f"{replaced:,} of {records:,} records ({replaced / records:.2%}, over "
                f"{REPLACED_WARNING:.0%}) had invalid UTF-8 replaced by U+FFFD: is the input in "
                f"another encoding? first: {', '.join(self.first['invalid_utf8'][:3])}")


class ShardWriter:
    """Appends unit results to shard `index` under temporary names; commit() renames the
    tokens, then the index, then writes the shard record that marks it done."""

    def __init__(self, directory: pathlib.Path, index: int, first_unit: int, dtype: str,
                 masked: bool = False):
        self.directory, self.index, self.dtype = directory, index, np.dtype(dtype)
        self.names = fmt.shard_names(index)
        self.tmp = directory / (self.names[0] + ".tmp")
        self.file = open(self.tmp, "wb")
        # --chat: the loss mask beside the tokens, one uint8 a token
        self.mask_tmp = directory / (fmt.mask_name(index) + ".tmp") if masked else None
        self.mask_file = open(self.mask_tmp, "wb") if masked else None
        self.sha = hashlib.sha256()
        self.lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self.units = [first_unit, first_unit]
        self.records_end = 0
        self.stream = {key: fingerprints.join_stream_hashes([])
                       for key in ("tokens", "lengths") + (("mask",) if masked else ())}

    def add(self, unit_index: int, result: UnitResult) -> None:
        data = result.tokens.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.lengths.append(result.lengths)
        self.num_tokens += len(result.tokens)
        if self.mask_file is not None:
            self.mask_file.write(result.mask.astype(np.uint8, copy=False).tobytes())
        counts = [("tokens", len(result.tokens)), ("lengths", len(result.lengths))]
        if self.mask_file is not None:
            counts.append(("mask", len(result.tokens)))
        for key, count in counts:
            self.stream[key] = fingerprints.join_stream_hashes(
                [(self.stream[key], 0), (result.stream[key], count)])
        self.units[1] = unit_index + 1

    def commit(self, report: Report) -> dict:
        for file in (self.file, self.mask_file):
            if file is not None:
                file.flush()
                os.fsync(file.fileno())
                file.close()
        mask_name = fmt.mask_name(self.index) if self.mask_file is not None else None
        tokens_name, index_name, record_name = self.names
        lengths = (np.concatenate(self.lengths) if self.lengths
                   else np.empty(0, dtype=np.int64))
        if self.num_tokens:
            starts = np.cumsum(lengths) - lengths
            with open(self.directory / (index_name + ".tmp"), "wb") as f:
                np.save(f, np.stack([starts, lengths], axis=1).astype(np.int64))
                f.flush()
                os.fsync(f.fileno())
            os.replace(self.tmp, self.directory / tokens_name)
            if mask_name is not None:
                os.replace(self.mask_tmp, self.directory / mask_name)
            os.replace(self.directory / (index_name + ".tmp"), self.directory / index_name)
        else:
            self.tmp.unlink()
            if mask_name is not None:
                self.mask_tmp.unlink()
        record = {"index": self.index, "units": self.units, "records_end": self.records_end,
                  "tokens": tokens_name if self.num_tokens else None,
                  "index_file": index_name if self.num_tokens else None,
                  "num_tokens": self.num_tokens, "num_documents": int(len(lengths)),
                  "sha256": self.sha.hexdigest(), "stream": self.stream,
                  "report": report.to_json(),
                  "lines_before": {str(k): v for k, v in report.lines_before.items()}}
        if mask_name is not None:
            record["mask"] = mask_name if self.num_tokens else None
        storage.write_json(self.directory / record_name, record, sort_keys=True)
        return record

    def abandon(self) -> None:
        """Frees what the unfinished shard took (on out-of-disk or an abort)."""
        self.file.close()
        if self.mask_file is not None:
            self.mask_file.close()
        for name in (self.names[0], self.names[1], fmt.mask_name(self.index)):
            (self.directory / (name + ".tmp")).unlink(missing_ok=True)


def committed(staging: pathlib.Path) -> list[dict]:
    """Shard records 0..k-1 present in order (a gap ends the list); later leftovers go."""
    kept = []
    while True:
        path = staging / fmt.shard_names(len(kept))[2]
        if not path.is_file():
            break
        record = json.loads(path.read_text())
        if "stream" not in record:  # left by a jaxtrain before stream hashes: redone
            break
        kept.append(record)
    for leftover in staging.glob("*.tmp"):
        leftover.unlink()
    index = len(kept)
    names = lambda k: (*fmt.shard_names(k), fmt.mask_name(k))  # noqa: E731
    while any((staging / name).exists() for name in names(index)):
        for name in names(index):
            (staging / name).unlink(missing_ok=True)
        index += 1
    return kept
