"""A train state written and read in place, on disk or on a bucket: each process writes only
the shards it owns and reads only the pieces its devices need (issue 36).

Layout of one step, written through storage.AtomicSet (on a bucket straight under the
step's prefix, the marker object last; on disk in `<step>.partial/`, renamed):

    <step>/state.p<i>.<k>.bin   process i's shards, concatenated (parts of <= PART_BYTES)
    <step>/state.p<i>.json      process i's index: every leaf's shape and dtype, and for
                                each of its shards the leaf, the box it covers, where its
                                bytes lie and their xxh3
    <step>/commit.json          process 0's marker, once every process has written its
                                parts and index: how many processes wrote, and the caller's
                                JSON (the run's config, the fingerprints)

A shard is written by the process that holds its replica 0, so each element is written
once whatever the replication. A checkpoint costs 2 objects per process (more only past
PART_BYTES) and the marker, not one per chunk: the objects are tensorstore kvstore values
(gcs, s3 or file), each written in one request. A restore reads the marker and every
index (metadata: O(processes) small objects), then, on each process, the byte ranges of
the pieces its devices' shards overlap, and nothing else: on the mesh it was saved with, a
process reads its 1/N of the state, its pieces adjacent in its part: in one request per
process that wrote them. Every piece read is checked against its xxh3, and the
processes' verdicts are combined (a step damaged anywhere is damaged everywhere), so all of
them fall back together. Nothing is written to the host's disk on a bucket.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import xxhash

# jax exposes no public handle on the coordination service's key-value store (orbax reaches
# it the same way, orbax/checkpoint/_src/multihost).
from jax._src import distributed

from jaxtrain import retry, storage
from jaxtrain.errors import CheckpointError

PART_BYTES = 1 << 30  # under S3's 5 GiB single-PUT limit, few objects per process
FORMAT = "shards-1"
_WAIT_MS = 600_000  # for the other processes' parts, at a commit or a verdict
_UNREACHABLE = "\0"  # a verdict that is no verdict: the process lost the store


_PART = re.compile(r"state\.p\d+\.\d+\.bin")


class Refused(CheckpointError):
    """A step that is no accident (an index naming objects outside the step): refused,
    never set aside as damaged."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """One saved shard: its leaf, the box [(start, stop), ...] it covers, where its bytes lie
    (part object, offset, size) and their xxh3."""
    leaf: str
    box: tuple[tuple[int, int], ...]
    part: str
    offset: int
    size: int
    digest: str


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def _box(index: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _overlap(a, b):
    """The intersection of two boxes, or None."""
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _local(box, within):
    """`box` as slices relative to the box `within`."""
    return tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(box, within))


def _process_key(what: str) -> str:
    return f"jaxtrain_shards/{what}"


def _barrier(name: str) -> None:
    if jax.process_count() > 1:  # the coordination service's, usable from any thread
        distributed.global_state.client.wait_at_barrier(_process_key(name), _WAIT_MS)


@dataclasses.dataclass
class HostCopy:
    """This process's shards of a pytree, copied to host memory (`host_copy`): what `write`
    puts in the step's objects, so that the training thread may go on changing the
    arrays while it does."""
    leaves: dict[str, list]
    pieces: list[list]
    parts: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(part) for part in self.parts)


def host_copy(tree) -> HostCopy:
    """The shards of a pytree of jax.Arrays this process writes (those whose replica 0 its
    devices hold), copied to the host, laid out in parts of <= PART_BYTES."""
    me = jax.process_index()
    leaves, pieces, part, parts, offset = {}, [], [], [], 0
    for path_, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _name(path_)
        leaves[name] = [list(leaf.shape), str(leaf.dtype)]
        for shard in leaf.addressable_shards:
            if shard.replica_id != 0:
                continue  # another device (maybe another process) writes this one
            data = np.ascontiguousarray(np.asarray(shard.data)).tobytes()
            if offset and offset + len(data) > PART_BYTES:
                parts.append(b"".join(part))
                part, offset = [], 0
            pieces.append([name, _box(shard.index, leaf.shape), f"state.p{me}.{len(parts)}.bin",
                           offset, len(data), xxhash.xxh3_64_hexdigest(data)])
            part.append(data)
            offset += len(data)
    parts.append(b"".join(part))
    return HostCopy(leaves, pieces, parts)


def write(path, host: HostCopy, marker: dict, tag: str) -> str | None:
    """Writes this process's copy under `path` (a step's directory); once every process has
    (their verdicts combined under `tag`, the same on every process), process 0 commits it
    with `marker` in the marker object. Blocking (the caller's background thread). Returns
    None once committed, else what stopped it (the same on every process): a process that
    could not write leaves the step uncommitted everywhere. A lost store raises
    retry.Unreachable on the process that met it."""
    me = jax.process_index()
    writer = storage.AtomicSet(path)
    problem = None
    try:
        for k, blob in enumerate(host.parts):
            writer.write(f"state.p{me}.{k}.bin", blob)
        writer.write(f"state.p{me}.json",
                     json.dumps({"leaves": host.leaves, "pieces": host.pieces}).encode())
    except Exception as e:  # noqa: BLE001 - said to the others, then raised here
        problem = storage.first_line(e)
        combined(problem, f"save/{tag}")
        raise
    if problem := combined(problem, f"save/{tag}"):
        return problem
    if me == 0:
        writer.commit(json.dumps({"format": FORMAT, "processes": jax.process_count(),
                                  **marker}).encode())
    _barrier(f"committed/{tag}")
    return None


def save(path, tree, marker: dict, tag: str) -> None:
    """host_copy, then write: blocking, in one call."""
    if problem := write(path, host_copy(tree), marker, tag):
        raise CheckpointError(f"{path} was not committed: {problem}")


def marker(path) -> dict | None:
    """The marker of a committed step (None: not committed, or not in this format); a lost
    store raises retry.Unreachable."""
    data = storage.AtomicSet.committed(path)
    try:
        found = json.loads(data) if data else None
    except ValueError:
        return None
    return found if found and found.get("format") == FORMAT else None


def signature(path) -> dict[tuple, tuple]:
    """{leaf path: (shape, dtype)} of a committed step, from process 0's index."""
    index = _read_indices(storage.kvstore(path), 1)[0]
    return {tuple(name.split("/")): (tuple(shape), dtype)
            for name, (shape, dtype) in index["leaves"].items()}


def _settled(future, start, what: str):
    """The result of a read already started; one that failed for a reason worth trying
    again (or did not answer within the budget) is read again under the retry policy."""
    try:
        return future.result(timeout=retry.budget_s())
    except Exception as e:
        future.cancel()
        if not retry.transient(e):
            raise
    return storage.settled(start, what)


def _read_indices(store, processes: int) -> list[dict]:
    names = [f"state.p{i}.json" for i in range(processes)]
    futures = [store.read(name) for name in names]
    results = [_settled(f, lambda name=name: store.read(name), f"reading {name}")
               for f, name in zip(futures, names)]
    missing = [i for i, r in enumerate(results) if r.state != "value"]
    if missing:
        raise CheckpointError(f"state.p{missing[0]}.json is missing")
    return [json.loads(r.value) for r in results]


class Reader:
    """The pieces of one committed step that this process's devices need: read once, each
    checked against its digest (`problem`: what is wrong with them, None if nothing)."""

    def __init__(self, path, processes: int):
        self.path = path
        self.store = storage.kvstore(path)
        self.pieces: dict[str, list[Piece]] = {}
        for index in _read_indices(self.store, processes):
            for leaf, box, part, offset, size, digest in index["pieces"]:
                if not _PART.fullmatch(str(part)):  # a key elsewhere in the bucket
                    raise Refused(f"checkpoint {path}: its index names {part!r} as a part: "
                                  "not one of the step's (state.p<i>.<k>.bin); refused, "
                                  "nothing read, nothing moved")
                self.pieces.setdefault(leaf, []).append(
                    Piece(leaf, tuple(map(tuple, box)), part, offset, size, digest))
        self.data: dict[Piece, np.ndarray] = {}

    def needed(self, name: str, box) -> list[Piece]:
        return [p for p in self.pieces.get(name, ()) if _overlap(p.box, box) is not None]

    def fetch(self, wanted: set[Piece], dtypes: dict[str, np.dtype]) -> str | None:
        """Reads every wanted piece (pieces adjacent in one part in one byte-range read, all
        reads at once); what is wrong with them, None if nothing."""
        runs: list[list[Piece]] = []
        for piece in sorted(wanted, key=lambda p: (p.part, p.offset)):
            last = runs[-1][-1] if runs else None
            if last and last.part == piece.part and last.offset + last.size == piece.offset:
                runs[-1].append(piece)
            else:
                runs.append([piece])
        def reading(run):
            return lambda: self.store.read(run[0].part, byte_range=slice(
                run[0].offset, run[-1].offset + run[-1].size))
        futures = [reading(run)() for run in runs]  # all at once; a retry one by one
        for run, future in zip(runs, futures):
            shown = f"{self.path}/{run[0].part}"
            size = run[-1].offset + run[-1].size - run[0].offset
            try:
                result = _settled(future, reading(run), f"reading {shown}")
            except ValueError as e:  # tensorstore's OUT_OF_RANGE: a short object
                return f"{shown} cannot be read at {run[0].offset}+{size} ({e})"
            if result.state != "value":
                return f"{shown} is missing"
            if len(result.value) != size:
                return f"{shown} is truncated ({len(result.value)} of {size} bytes)"
            for piece in run:
                start = piece.offset - run[0].offset
                data = result.value[start:start + piece.size]
                if (digest := xxhash.xxh3_64_hexdigest(data)) != piece.digest:
                    return (f"{shown} has changed at {piece.offset}+{piece.size} (checksum "
                            f"{digest}, recorded {piece.digest})")
                shape = tuple(hi - lo for lo, hi in piece.box)
                self.data[piece] = np.frombuffer(data, dtypes[piece.leaf]).reshape(shape)
        return None

    def assemble(self, name: str, box, dtype) -> np.ndarray | None:
        """The box of leaf `name`, from the pieces read; None if they do not cover it."""
        out = np.empty(tuple(hi - lo for lo, hi in box), dtype)
        covered = 0
        for piece in self.needed(name, box):
            common = _overlap(piece.box, box)
            out[_local(common, box)] = self.data[piece][_local(common, piece.box)]
            covered += int(np.prod([hi - lo for lo, hi in common]))
        return out if covered == out.size else None


def combined(problem: str | None, tag: str) -> str | None:
    """Every process's verdict on a step, combined: this one's problem, else the first that
    another process found, else None. Through the coordination service (any thread)."""
    if jax.process_count() == 1:
        return problem
    client = distributed.global_state.client
    client.key_value_set(_process_key(f"verdict/{tag}/{jax.process_index()}"), problem or "")
    if problem:
        return problem
    for rank in range(jax.process_count()):
        other = client.blocking_key_value_get(_process_key(f"verdict/{tag}/{rank}"), _WAIT_MS)
        if other.startswith(_UNREACHABLE):  # no verdict on the step: the store is lost
            raise retry.Unreachable(f"{other[1:]} (met by process {rank})", other[1:])
        if other:
            return f"{other} (found by process {rank})"
    return None


def _unreachable(error: retry.Unreachable, tag: str) -> retry.Unreachable:
    """Tells the other processes (waiting on a verdict under `tag`) that this one lost the
    store, so that they raise too rather than judge the step; returns `error`."""
    if jax.process_count() > 1:
        distributed.global_state.client.key_value_set(
            _process_key(f"verdict/{tag}/{jax.process_index()}"), _UNREACHABLE + str(error))
    return error


def restore(path, target, tag: str) -> tuple[dict | None, str | None]:
    """(the pytree restored into `target`'s shapes, dtypes and shardings — any mesh —, None)
    or (None, what is wrong with the step), the verdict the same on every process."""
    found = marker(path)
    if found is None:
        return None, combined(f"{path} has no commit marker", tag)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    try:
        reader = Reader(path, found["processes"])
    except retry.Unreachable as e:
        raise _unreachable(e, tag) from None
    except Refused:
        raise  # every process reads the same indices: all refuse it
    except (CheckpointError, ValueError) as e:
        return None, combined(f"{path}: {storage.first_line(e)}", tag)
    wanted, boxes = set(), []
    for path_, leaf in flat:
        devices = leaf.sharding.addressable_devices_indices_map(leaf.shape)
        boxes.append({d: _box(i, leaf.shape) for d, i in devices.items()})
        for box in set(boxes[-1].values()):
            wanted.update(reader.needed(_name(path_), box))
    try:
        problem = reader.fetch(wanted, {_name(p): np.dtype(leaf.dtype) for p, leaf in flat})
    except retry.Unreachable as e:
        raise _unreachable(e, tag) from None
    if problem := combined(problem, tag):
        return None, problem
    arrays = []
    for (path_, leaf), by_device in zip(flat, boxes):
        parts = {box: reader.assemble(_name(path_), box, np.dtype(leaf.dtype))
                 for box in set(by_device.values())}
        if any(part is None for part in parts.values()):
            return None, combined(f"{path} does not cover {_name(path_)}", tag + "/cover")
        arrays.append(jax.make_array_from_single_device_arrays(
            leaf.shape, leaf.sharding,
            [jax.device_put(parts[box], device) for device, box in by_device.items()]))
    if problem := combined(None, tag + "/cover"):
        return None, problem
    return jax.tree_util.tree_unflatten(treedef, arrays), None



def set_aside(path, aside) -> None:
    """Moves a damaged step from `path` to `aside` (e.g. `<dir>_damaged/<step>-<time>`),
    kept for inspection, never deleted; from the first change on, it is no step of `path`
    (storage.AtomicSet.move says how, on disk and on a bucket)."""
    storage.AtomicSet.move(path, aside)
