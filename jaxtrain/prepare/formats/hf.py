"""Hugging Face datasets saved with `save_to_disk` (a directory; memory-mapped Arrow), cut
into units by rows. A dataset streamed with --hf-dataset is no input format: the pipeline
reads its rows itself (readers.read_stream_rows), as the pseudo-format STREAM."""

from __future__ import annotations

import pathlib

from jaxtrain.errors import DataError
from jaxtrain.prepare import records
from jaxtrain.prepare.formats.base import InputFormat
from jaxtrain.prepare.records import Unit

PACKAGE = "datasets"
STREAM = "hf-stream"  # the format of the one input of a streamed --hf-dataset
MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_DATASETS: dict = {}


def is_saved(path: pathlib.Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in MARKERS)


def _open(path: str, split: str):
    """A dataset saved with save_to_disk (memory-mapped Arrow), opened once per process."""
    key = (path, split)
    if key not in _DATASETS:
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
        _DATASETS[key] = loaded
    return _DATASETS[key]


def _scaled(position: int, count: int, size: int) -> int:
    """The first of `count` items spread evenly over `size` bytes (item k at byte
    k * size / count) at or after byte `position`, clamped to [0, count]."""
    if position <= 0:
        return 0
    if size == 0:
        return count
    return min(-(-position * count // size), count)


def _units(i, item, options, unit_bytes, lo, hi) -> list[Unit]:
    rows = len(_open(item.path, options.split))
    first, last = (_scaled(lo, rows, item.size), _scaled(hi, rows, item.size))
    per = max(1, int(rows * unit_bytes / max(item.size, 1)))
    return [Unit(i, i + 1, a, min(a + per, last), size=item.size * (min(a + per, last) - a)
                 // max(rows, 1)) for a in range(first, last, per)]


def _read(unit, i, item, options, tally, docs) -> None:
    ds = _open(item.path, options.split)
    if options.chat is not None:
        columns = records.chat_columns(ds.column_names, item.path, options.chat)
        table = ds.select_columns(columns)[unit.start:unit.stop]
        for row, values in enumerate(zip(*(table[c] for c in columns)), start=unit.start + 1):
            tally.records += 1
            records.keep_record(dict(zip(columns, values)), docs, tally, (i, "row", row))
        return
    if options.field not in ds.column_names:
        raise DataError(f"input {item.path}: no column {options.field!r} (--field); its "
                        f"columns are {', '.join(ds.column_names)}")
    values = ds[unit.start:unit.stop][options.field]
    for row, value in enumerate(values, start=unit.start + 1):
        tally.records += 1
        text = records.field_value(value, tally, (i, "row", row))
        if text is not None:
            records.keep(text, docs, tally, (i, "row", row))


FORMAT = InputFormat("hf", units=_units, read=_read, claims=lambda path: path.is_dir(),
                     package=PACKAGE)
