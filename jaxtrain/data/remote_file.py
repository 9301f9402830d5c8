"""Training data on object storage: read-only arrays over gs:// and s3:// objects, read by
range requests through one bounded block cache per process.

On a local disk a token file is memory-mapped and only the pages a batch touches are read.
`RemoteArray` is the same for an object: slicing it is free (a view, like a memmap's), and
`np.asarray(view)` reads the fixed-size blocks (`data.block_kb`) the view overlaps, each with
one range request, through `BlockCache`, an LRU of blocks bounded by `data.cache_mb` and
shared by every array of the process. A host therefore reads the blocks of the rows it
trains on and nothing else, and what it reads is the same bytes a local copy holds: batches
stay a pure function of (seed, step) whatever the storage.

The cache is in memory, not on local disk: a shuffled run reads each block about once an
epoch, so a disk cache would mostly hold blocks that are not read again; memory needs no
clean-up, never goes stale across runs and cannot fill a disk. A dataset read many times
over is better copied to local disk once (then `data.path` names the copy).

grain reads rows from threads: the cache is locked, and a block that several threads want
at once is fetched once. A request that fails for a passing reason (a lost connection, a
server error) is retried with backoff after the client's own retries; then, or at once for
a missing object, the read fails with one line naming the object. `stats()` counts the
requests and bytes (the benchmarks' requests per step).
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from jaxtrain import retry, storage
from jaxtrain.errors import ConfigError, DataError

DEFAULT_CACHE_MB = 512
DEFAULT_BLOCK_KB = 256
ATTEMPTS = 4  # range requests per block before giving up
BACKOFF_S = 0.5  # before the second attempt; doubled before each next one

_counts_lock = threading.Lock()
_counts = {"requests": 0, "bytes": 0, "retries": 0}


def stats() -> dict:
    """Requests and bytes read from object storage by this process (range and whole-object
    reads), and retried requests; with the shared cache's hits, misses and size."""
    with _counts_lock:
        counts = dict(_counts)
    cache = _shared
    return {**counts, **(cache.stats() if cache else {"hits": 0, "misses": 0,
                                                      "cached_bytes": 0})}


def reset_stats() -> None:
    with _counts_lock:
        for key in _counts:
            _counts[key] = 0
    if _shared is not None:
        _shared.hits = _shared.misses = 0


def _count(key: str, n: int = 1) -> None:
    with _counts_lock:
        _counts[key] += n


def _permanent(error: BaseException) -> bool:
    """A failure that trying again cannot fix: the one classifier's verdict (retry.py)."""
    return not retry.transient(error)


def _retrying(call, url: str, what: str, missing_ok: bool = False):
    """call() with up to ATTEMPTS tries; DataError (one line, naming the object) when the
    object is missing (None if missing_ok) or every try failed, ConfigError for
    credentials/bucket/permission."""
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - each client raises its own
            if isinstance(e, FileNotFoundError):
                if missing_ok:
                    return None
                raise DataError(f"{what}: {url} does not exist (was the dataset moved or "
                                "deleted while in use?)") from None
            user = storage.user_error(e, what, url)
            if user is not None:
                raise user from None
            if _permanent(e) or attempt == ATTEMPTS - 1:
                tries = f" after {attempt + 1} attempts" if attempt else ""
                raise DataError(f"{what}: cannot read {url}{tries}: "
                                f"{storage.first_line(e)}") from None
            _count("retries")
            time.sleep(BACKOFF_S * 2 ** attempt)


def read_range(path, start: int, end: int, what: str = "data.path") -> bytes:
    """Bytes [start, end) of an object: one range request (retried)."""
    fs, name = storage.filesystem(path)
    data = _retrying(lambda: fs.cat_file(name, start=start, end=end), str(path), what)
    _count("requests")
    _count("bytes", len(data))
    return data


def read_whole(path, what: str = "data.path", missing_ok: bool = False) -> bytes | None:
    """A small object read whole (a manifest, a document index): one request (retried);
    None for a missing object if missing_ok."""
    fs, name = storage.filesystem(path)
    data = _retrying(lambda: fs.cat_file(name), str(path), what, missing_ok)
    _count("requests")
    if data is not None:
        _count("bytes", len(data))
    return data


def object_info(path, what: str = "data.path") -> dict | None:
    """The object's metadata (size, ETag or generation: one request), or None when there
    is none."""
    fs, name = storage.filesystem(path)
    info = _retrying(lambda: fs.info(name), str(path), what, missing_ok=True)
    _count("requests")
    return None if info is None or info.get("type") == "directory" else info


def object_size(path, what: str = "data.path") -> int | None:
    """The object's size in bytes (a metadata request), or None when there is none."""
    info = object_info(path, what)
    return None if info is None else int(info["size"])


class BlockCache:
    """An LRU of fixed-size blocks of objects, at most `capacity_bytes` held (a block larger
    than that is handed to its reader and not kept)."""

    def __init__(self, capacity_bytes: int, block_bytes: int):
        self.capacity, self.block_bytes = capacity_bytes, block_bytes
        self._lock = threading.Lock()
        self._blocks: collections.OrderedDict = collections.OrderedDict()
        self._fetching: dict = {}  # key -> Event, set when its fetch ends
        self.size = self.peak = self.hits = self.misses = 0

    def stats(self) -> dict:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "cached_bytes": self.size,
                    "peak_cached_bytes": self.peak}

    def resize(self, capacity_bytes: int) -> None:
        with self._lock:
            self.capacity = capacity_bytes
            self._evict()

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.size = 0

    def _evict(self) -> None:
        while self.size > self.capacity and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.size -= len(block)

    def get(self, key, fetch) -> bytes:
        """The block named `key`, from the cache or from fetch() (one fetch per key at a
        time, however many threads ask)."""
        while True:
            with self._lock:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    self.hits += 1
                    return self._blocks[key]
                waiting = self._fetching.get(key)
                if waiting is None:
                    self._fetching[key] = threading.Event()
                    self.misses += 1
                    break
            waiting.wait()  # then it is cached, or its fetch failed and this thread tries
        block = None
        try:
            block = fetch()
            return block
        finally:
            with self._lock:
                if block is not None:
                    self._blocks[key] = block
                    self.size += len(block)
                    self.peak = max(self.peak, min(self.size, self.capacity))
                    self._evict()
                self._fetching.pop(key).set()


_shared: BlockCache | None = None
_shared_lock = threading.Lock()


def shared_cache(cache_mb: int = DEFAULT_CACHE_MB,
                 block_kb: int = DEFAULT_BLOCK_KB) -> BlockCache:
    """The process's block cache, sized as asked (a new block size starts an empty one)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.block_bytes != block_kb << 10:
            _shared = BlockCache(cache_mb << 20, block_kb << 10)
        else:
            _shared.resize(cache_mb << 20)
        return _shared


def cache_for(c) -> BlockCache:
    """The shared cache as the config sizes it (data.cache_mb, data.block_kb)."""
    return shared_cache(c.data.cache_mb, c.data.block_kb)


def check_cache_config(c) -> None:
    """ConfigError (one line) for cache sizes that cannot work."""
    block_kb, cache_mb = c.data.block_kb, c.data.cache_mb
    if not isinstance(block_kb, int) or block_kb < 4 or block_kb > 65536 or \
            block_kb & (block_kb - 1):
        raise ConfigError(f"data.block_kb={block_kb!r} is invalid: a power of two from 4 to "
                          "65536 (KiB per range request on object storage)")
    if not isinstance(cache_mb, int) or cache_mb << 10 < 2 * block_kb:
        raise ConfigError(f"data.cache_mb={cache_mb!r} is invalid: at least two blocks of "
                          f"data.block_kb={block_kb} (MiB of object-storage data cached in "
                          "memory per process)")


class RemoteArray:
    """A read-only 1-D array of `dtype` over an object (a token shard, a .bin file).

    `len()`, `shape`, `dtype`, `a[lo:hi]` (a view, nothing read), `a[i]`, `read(lo, hi)` and
    `np.asarray(a)` (reads the view's bytes through the cache)."""

    def __init__(self, path, dtype, cache: BlockCache | None = None, nbytes: int | None = None,
                 what: str = "data.path", _window: tuple[int, int] | None = None):
        self.path, self.url, self.what = path, str(path), what
        self.dtype = np.dtype(dtype)
        self.cache = cache if cache is not None else shared_cache()
        if nbytes is None:
            nbytes = object_size(path, what)
            if nbytes is None:
                raise DataError(f"{what}: {path} does not exist")
        self.nbytes_object = nbytes
        self._start, self._stop = _window or (0, nbytes // self.dtype.itemsize)

    def __len__(self) -> int:
        return self._stop - self._start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                raise IndexError("a RemoteArray takes contiguous slices only")
            return RemoteArray(self.path, self.dtype, self.cache, self.nbytes_object,
                               self.what, (self._start + lo, self._start + max(hi, lo)))
        index = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= index < len(self):
            raise IndexError(f"index {key} is out of bounds for length {len(self)}")
        return self.read(index, index + 1)[0]

    def __array__(self, dtype=None, copy=None):
        values = self.read(0, len(self))
        return values if dtype is None else values.astype(dtype, copy=False)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of the view, as a new array of its dtype."""
        size = self.dtype.itemsize
        start, end = (self._start + lo) * size, (self._start + hi) * size
        if end <= start:
            return np.zeros(0, self.dtype)
        b = self.cache.block_bytes
        first, last = start // b, (end - 1) // b
        blocks = [self._block(k) for k in range(first, last + 1)]
        data = blocks[0] if len(blocks) == 1 else b"".join(blocks)
        offset = start - first * b
        return np.frombuffer(data, self.dtype, (end - start) // size, offset).copy()

    def _block(self, k: int) -> bytes:
        b = self.cache.block_bytes
        end = min((k + 1) * b, self.nbytes_object)
        return self.cache.get((self.url, self.nbytes_object, b, k),
                              lambda: read_range(self.path, k * b, end, self.what))

    def sampled_max(self, samples: int = 8) -> int:
        """The largest value in `samples` evenly spaced block-sized stretches (first and last
        included): a check of the dtype and vocabulary that reads a few blocks, where max()
        would read the whole object."""
        span = max(self.cache.block_bytes // self.dtype.itemsize, 1)
        n = len(self)
        if n <= span * samples:
            return int(np.asarray(self).max())
        starts = {(n - span) * k // (samples - 1) for k in range(samples)}
        return max(int(self.read(s, s + span).max()) for s in starts)
