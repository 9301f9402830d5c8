"""Reading and writing Hugging Face safetensors directories, one tensor at a time.

Only safetensors' numpy API is used: no torch, no transformers.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from contextlib import ExitStack

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxtrain import storage
from jaxtrain.errors import ConfigError, DataError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_config(directory: pathlib.Path) -> dict:
    """config.json of a Hugging Face model directory, or a one-line ConfigError."""
    if not directory.is_dir():
        raise ConfigError(f"--from-hf={directory}: no such directory")
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"--from-hf={directory} holds no config.json: not a Hugging Face "
                          "model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


class SafetensorsDir:
    """The tensors of model.safetensors, or of the shards a model.safetensors.index.json
    lists, opened lazily; `read` returns a slice of one tensor and reads nothing else."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self._stack = ExitStack()
        self._open: dict[str, object] = {}
        self.files: dict[str, str] = {}  # tensor name -> file name
        index = directory / INDEX
        if index.is_file():
            self.files = dict(json.loads(index.read_text())["weight_map"])
        else:
            shards = sorted(p.name for p in directory.glob("*.safetensors"))
            if not shards:
                other = sorted(p.name for p in directory.glob("*.bin"))
                hint = (f" ({', '.join(other)} are torch pickles: load and save_pretrained "
                        "them with transformers to get safetensors)") if other else ""
                raise ConfigError(f"--from-hf={directory} holds no *.safetensors{hint}")
            for name in shards:
                for key in self._handle(name).keys():
                    self.files[key] = name
        for name in sorted(set(self.files.values())):
            # A model directory from the Hub cache links its files to blobs beside it.
            path = storage.contained(directory, name, f"--from-hf={directory}: {INDEX}'s "
                                     "weight_map", ConfigError, links=True)
            if not path.is_file():
                raise ConfigError(f"{directory / name} is missing (listed in {INDEX})")

    def check_readable(self) -> None:
        """DataError (one line, naming the file) for a file safetensors cannot open: a
        truncated or damaged download, checked before anything is read or written."""
        for name in sorted(set(self.files.values())):
            self._handle(name)

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _handle(self, file: str):
        if file not in self._open:
            try:
                self._open[file] = self._stack.enter_context(
                    safe_open(str(self.directory / file), framework="numpy"))
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: the file's fault
                raise DataError(f"{self.directory / file} is not a readable safetensors file "
                                f"({storage.first_line(e)}): download it again") from None
        return self._open[file]

    def resolve(self, name: str) -> str | None:
        """The stored name of `name`: as given, or without its first component (a base model
        saved without its head: GPT2Model's `h.0...` for `transformer.h.0...`)."""
        if name in self.files:
            return name
        short = name.split(".", 1)[-1]
        return short if short in self.files else None

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self.resolve(name)
        return tuple(self._handle(self.files[stored]).get_slice(stored).get_shape())

    def read(self, name: str, axis: int = 0, start: int = 0, stop: int | None = None
             ) -> np.ndarray:
        """Elements [start, stop) of `axis` of one tensor, as float32."""
        stored = self.resolve(name)
        part = self._handle(self.files[stored]).get_slice(stored)
        shape = part.get_shape()
        index = tuple(slice(start, stop) if a == axis else slice(None)
                      for a in range(len(shape)))
        if part.get_dtype() in ("BF16", "F8_E4M3", "F8_E5M2"):  # no numpy dtype of their own
            return _mapped(self.directory / self.files[stored], stored)[index].astype(np.float32)
        return np.asarray(part[index] if shape else part[:], dtype=np.float32)


def _mapped(path: pathlib.Path, name: str) -> np.ndarray:
    """A memory map of one tensor whose dtype numpy lacks (bfloat16, fp8), via ml_dtypes."""
    import ml_dtypes

    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(size))[name]
    dtype = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
             "F8_E5M2": ml_dtypes.float8_e5m2}[entry["dtype"]]
    begin, end = entry["data_offsets"]
    count = (end - begin) // np.dtype(dtype).itemsize
    return np.memmap(path, dtype=dtype, mode="r", offset=8 + size + begin,
                     shape=(count,)).reshape(entry["shape"])


def parse_size(text: str) -> int:
    """'2GB', '500MB', '10KB' (powers of 1000, as transformers) or a number of bytes."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10,
             "B": 1}
    value = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if value.endswith(unit):
            try:
                return int(float(value[: -len(unit)]) * units[unit])
            except ValueError:
                break
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"--max_shard_size={text!r} is invalid: a size like 2GB, 500MB "
                          "or a number of bytes") from None


class SafetensorsWriter:
    """Writes tensors into safetensors files of at most `max_bytes` each (a larger tensor
    gets a file to itself) as they fill, then names them as transformers expects: one
    model.safetensors, or model-0000k-of-0000n.safetensors and an index."""

    def __init__(self, directory: pathlib.Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # tensor names per written file
        self.total_bytes = 0

    def _path(self, k: int) -> pathlib.Path:
        return self.directory / f".model-{k + 1:05d}.safetensors.partial"

    def add(self, name: str, array: np.ndarray) -> None:
        if self.pending and self.pending_bytes + array.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = np.ascontiguousarray(array)
        self.pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        save_file(self.pending, str(self._path(len(self.shards))), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Writes what is left and the index; returns the file names written."""
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        if count == 1:
            _publish(self._path(0), self.directory / SINGLE)
            return [SINGLE]
        names = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        weight_map = {}
        for k, (name, tensors) in enumerate(zip(names, self.shards)):
            _publish(self._path(k), self.directory / name)
            weight_map.update({tensor: name for tensor in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names + [INDEX]


def _publish(partial: pathlib.Path, final: pathlib.Path) -> None:
    """Renames a written file to its final name, readable as any file this process makes
    (safetensors creates its files private, 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o666 & ~umask)
    partial.rename(final)
