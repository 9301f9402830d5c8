"""The two shapes a prepare's work comes in, behind one interface, so that the pipeline
decides once (pipeline.layout_inputs) instead of asking at each step whether the input is
streamed: files cut into units (FileUnits), or the rows of a Hugging Face dataset streamed
with --hf-dataset (StreamedRows), taken about unit_bytes at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from jaxtrain.errors import DataError
from jaxtrain.prepare import readers, workers
from jaxtrain.prepare.records import Input, Options, Tally, Unit


@dataclasses.dataclass
class FileUnits:
    inputs: list[Input]
    units: list[Unit]
    options: Options

    def documents(self) -> Iterator[str]:
        """Every document, in order (to train a tokenizer on)."""
        for unit in self.units:
            yield from readers.read_unit(unit, self.inputs, self.options, Tally())

    def count(self) -> int | None:
        """About how many documents `documents` yields (the BPE trainer's progress)."""
        return sum(u.last - u.first for u in self.units)

    def total_bytes(self) -> int | None:
        return sum(u.size for u in self.units)

    def done_bytes(self, start_unit: int) -> int:
        return sum(u.size for u in self.units[:start_unit])

    def tasks(self, start_unit: int, records_start: int) -> Iterator[tuple]:
        """(unit index, records consumed after it, worker function, its argument)."""
        return ((k, 0, workers.work_unit, self.units[k])
                for k in range(start_unit, len(self.units)))

    def processes(self, wanted: int, start_unit: int) -> int:
        return min(wanted, max(len(self.units) - start_unit, 1))

    def input_of(self, k: int) -> int:
        return self.units[k].first


@dataclasses.dataclass
class StreamedRows:
    name: str  # --hf-dataset
    config: str | None
    options: Options
    unit_bytes: int
    units: list[Unit] = dataclasses.field(default_factory=list)  # none: rows, not units

    def documents(self) -> Iterator[str]:
        for _, rows in self._batches(0):
            yield from readers.read_stream_rows(rows, self.options.field, 0, Tally())

    def count(self) -> int | None:
        return None

    def total_bytes(self) -> int | None:
        return None

    def done_bytes(self, start_unit: int) -> int:
        return 0

    def tasks(self, start_unit: int, records_start: int) -> Iterator[tuple]:
        return ((k, first + len(rows), workers.work_rows, (first, rows)) for k, (first, rows)
                in enumerate(self._batches(records_start), start=start_unit))

    def processes(self, wanted: int, start_unit: int) -> int:
        return wanted

    def input_of(self, k: int) -> int:
        return 0

    def _batches(self, skip: int) -> Iterator[tuple[int, list]]:
        """(first row, rows) of the streamed dataset, about unit_bytes at a time."""
        try:
            import datasets
        except ImportError:
            raise DataError("--hf-dataset needs the datasets package: pip install "
                            "'jaxtrain[data]'") from None
        try:
            stream = datasets.load_dataset(self.name, name=self.config,
                                           split=self.options.split, streaming=True)
        except Exception as e:  # noqa: BLE001 - hub, network and builder errors vary widely
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"--hf-dataset={self.name}: cannot be loaded ({why})") from None
        if skip:
            stream = stream.skip(skip)
        rows, size, first = [], 0, skip
        for row in stream:
            rows.append(row)
            value = row.get(self.options.field) if isinstance(row, dict) else None
            size += len(value) if isinstance(value, str) else 1
            if size >= self.unit_bytes:
                yield first, rows
                first, rows, size = first + len(rows), [], 0
        if rows:
            yield first, rows
