"""Training data on object storage (jaxtrain/data/remote_file.py), against the real S3 and GCS
servers of tests/servers.py: the batches of a remote copy are the local copy's, reads go
through a bounded block cache, a host reads little more than the rows it trains on, and a
slow or briefly dead server is lived through."""

import threading

import jax
import numpy as np
import pytest
from conftest import object_server, small_config
from test_prepared_data import LOWER, UPPER, _letters, _prepare

from jaxtrain import storage
from jaxtrain.config import validate
from jaxtrain.data import remote_file
from jaxtrain.data.batches import make_batches
from jaxtrain.data.sources import SOURCES
from jaxtrain.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def local_data(tmp_path_factory):
    """Two small prepared datasets and a .bin file, made once on local disk."""
    root = tmp_path_factory.mktemp("local_data")
    _prepare(root, "a", _letters(LOWER, n=80))
    _prepare(root, "b", _letters(UPPER, n=60, seed=1))
    tokens = np.random.default_rng(0).integers(0, 256, 40_000, dtype=np.uint16)
    (root / "tokens.bin").write_bytes(tokens.tobytes())
    (root / "split").mkdir()
    (root / "split" / "train.bin").write_bytes(tokens[:30_000].tobytes())
    (root / "split" / "val.bin").write_bytes(tokens[30_000:].tobytes())
    return root


def _upload(root, bucket) -> str:
    """The local data under bucket/data (a dataset's manifest last, as prepare writes it)."""
    for name in ("a", "b"):
        storage.upload_tree(root / name, f"{bucket}/data/{name}", last="manifest.json")
    storage.upload_tree(root / "split", f"{bucket}/data/split")
    fs, key = storage.filesystem(f"{bucket}/data/tokens.bin")
    fs.put_file(str(root / "tokens.bin"), key)
    return f"{bucket}/data"


def _same_batches(local_cfg, remote_cfg) -> None:
    """Steps 0, 1 and 4 (a resume) and the validation batches: the same arrays."""
    mine, theirs = make_batches(local_cfg), make_batches(remote_cfg)
    for start in (0, 4):
        a, b = mine.train_iter(start), theirs.train_iter(start)
        for _ in range(2):
            _assert_same(next(a), next(b))
    for x, y in zip(mine.val_batches(), theirs.val_batches()):
        _assert_same(x, y)


def _assert_same(x, y) -> None:
    """Equal batches: token arrays, or Packed rows array by array (no mask is no array)."""
    assert jax.tree.structure(x) == jax.tree.structure(y)
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _cfg(**overrides):
    return small_config(**{"eval_batches": 2, **overrides})


def test_remote_prepared_data_gives_the_local_batches(local_data, bucket):
    remote = _upload(local_data, bucket)
    cases = [{"data.path": "{0}/a"},
             {"data.path": "{0}/a", "data.packing": "documents"},
             {"data.path": "{0}/a", "data.val_path": "{0}/b"},
             {"data.mixture": "{0}/a:0.7,{0}/b:0.3"}]
    for case in cases:
        local = {k: v.format(local_data) for k, v in case.items()}
        there = {k: v.format(remote) for k, v in case.items()}
        _same_batches(_cfg(**{"data.source": "prepared", **local}),
                      _cfg(**{"data.source": "prepared", **there}))
    # What the run records is what the data is, not where it lies; the tokenizer comes along.
    cfg = _cfg(**{"data.source": "prepared", "data.path": f"{remote}/a"})
    local_cfg = _cfg(**{"data.source": "prepared", "data.path": f"{local_data}/a"})
    source = SOURCES["prepared"]
    assert source.fingerprints(cfg)["data.path"]["fingerprint"] == \
        source.fingerprints(local_cfg)["data.path"]["fingerprint"]
    assert source.tokenizer(cfg).fingerprint() == source.tokenizer(local_cfg).fingerprint()


def test_remote_bin_files_give_the_local_batches(local_data, bucket):
    remote = _upload(local_data, bucket)
    for name in ("tokens.bin", "split"):
        local_cfg = _cfg(**{"data.source": "bin", "data.path": f"{local_data}/{name}"})
        cfg = _cfg(**{"data.source": "bin", "data.path": f"{remote}/{name}"})
        _same_batches(local_cfg, cfg)
        mine, theirs = (SOURCES["bin"].fingerprints(c) for c in (local_cfg, cfg))
        assert [v["fingerprint"] for v in mine.values()] == \
            [v["fingerprint"] for v in theirs.values()]
    # The vocabulary check samples blocks of a remote file, and still catches a bad dtype.
    with pytest.raises(DataError, match=r"tokens.bin holds token id \d+, outside model"):
        make_batches(_cfg(**{"data.source": "bin", "data.path": f"{remote}/tokens.bin",
                             "data.dtype": "uint32"}))


def test_the_cache_holds_at_most_its_bound(local_data, bucket):
    remote = _upload(local_data, bucket)
    expected = np.fromfile(local_data / "tokens.bin", dtype=np.uint16)
    cache = remote_file.BlockCache(capacity_bytes=4 * 4096, block_bytes=4096)
    array = remote_file.RemoteArray(f"{remote}/tokens.bin", "uint16", cache)
    assert len(array) == array.shape[0] == len(expected)
    rng = np.random.default_rng(0)
    for lo in rng.integers(0, len(expected) - 3000, 25):
        np.testing.assert_array_equal(np.asarray(array[lo:lo + 3000]), expected[lo:lo + 3000])
        assert cache.size <= cache.capacity
    assert cache.stats()["peak_cached_bytes"] == 4 * 4096 and cache.misses > 25
    view = array[100:200]  # a view reads nothing until converted
    assert view[5] == expected[105] and view[-1] == expected[199]


def test_a_host_reads_only_the_blocks_of_its_rows(tmp_path, bucket, monkeypatch):
    """Process 1 of 4 reads three steps' rows of an 8 MiB file: 4 KiB blocks of them."""
    tokens = np.random.default_rng(1).integers(0, 256, 1 << 22, dtype=np.uint16)
    path = f"{bucket}/big.bin"
    storage.atomic_write(storage.as_path(path), tokens.tobytes())
    cfg = _cfg(**{"data.source": "bin", "data.path": path, "data.block_kb": 4})
    monkeypatch.setattr("jax.process_count", lambda: 4)
    monkeypatch.setattr("jax.process_index", lambda: 1)
    batches = make_batches(cfg)
    remote_file.reset_stats()
    stream = batches.train_iter(0)
    rows = [next(stream) for _ in range(3)]
    read = remote_file.stats()
    assert all(r.shape == (4, 33) for r in rows)
    # Steps 0-2 and the 2 prefetched after them, 4 rows each: a 4 KiB block a row (two where
    # it crosses a block boundary), nothing else.
    assert 0 < read["requests"] <= 5 * 4 * 2 and read["bytes"] <= 5 * 4 * 2 * 4096, read
    assert read["bytes"] < tokens.nbytes / 40, read


def test_a_missing_prefix_is_one_line_naming_the_key(bucket):
    missing = f"{bucket}/nothing/here"
    for source, message in (
            ("prepared", f"data.path={missing} is not a prepared dataset (no manifest.json); "
                         "make one with jaxtrain prepare"),
            ("bin", f"data.path: token file {missing} does not exist")):
        with pytest.raises(DataError) as e:
            make_batches(_cfg(**{"data.source": source, "data.path": missing}))
        assert str(e.value) == message


def test_latency_and_a_server_that_comes_back(local_data, bucket):
    remote = _upload(local_data, bucket)
    server = object_server(bucket.split("://")[0])
    cfg = _cfg(**{"data.source": "prepared", "data.path": f"{remote}/a"})
    local_cfg = _cfg(**{"data.source": "prepared", "data.path": f"{local_data}/a"})
    server.proxy.delay_s = 0.05
    try:
        _same_batches(local_cfg, cfg)
    finally:
        server.proxy.delay_s = 0.0
    # Down for a second in the middle of reading: the clients and remote_file retry.
    array = remote_file.RemoteArray(f"{remote}/tokens.bin", "uint16")
    expected = np.fromfile(local_data / "tokens.bin", dtype=np.uint16)
    server.proxy.down()
    threading.Timer(1.0, server.proxy.up).start()
    np.testing.assert_array_equal(np.asarray(array[:5000]), expected[:5000])


def test_retries_then_one_line_naming_the_object(monkeypatch):
    monkeypatch.setattr(remote_file, "BACKOFF_S", 0.001)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError(104, "Connection reset by peer")
        return b"ok"

    assert remote_file._retrying(flaky, "s3://b/x.bin", "data.path") == b"ok"
    assert len(calls) == 3

    def down():
        raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(DataError) as e:
        remote_file._retrying(down, "s3://b/x.bin", "data.path")
    assert str(e.value) == ("data.path: cannot read s3://b/x.bin after 4 attempts: "
                            "ConnectionResetError: [Errno 104] Connection reset by peer")

    def gone():
        raise FileNotFoundError("s3://b/x.bin")

    with pytest.raises(DataError, match="^data.path: s3://b/x.bin does not exist"):
        remote_file._retrying(gone, "s3://b/x.bin", "data.path")


@pytest.mark.parametrize("overrides, message", [
    ({"data.block_kb": 3}, "data.block_kb=3 is invalid: a power of two"),
    ({"data.cache_mb": 0}, "data.cache_mb=0 is invalid: at least two blocks"),
])
def test_config_takes_data_urls_and_checks_the_cache(overrides, message):
    for ok in ({"data.source": "prepared", "data.path": "s3://b/ds"},
               {"data.source": "prepared", "data.mixture": "gs://b/a:0.5,s3://b/c:0.5",
                "data.val_path": "s3://b/v"},
               {"data.source": "bin", "data.path": "gs://b/x.bin"}):
        validate(_cfg(**ok), 1, "cpu")
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(**{"data.source": "bin", "data.path": "s3://b/x.bin", **overrides}),
                 1, "cpu")
