"""The path layer (jaxtrain/storage.py) against real servers started on 127.0.0.1."""

import pytest

from jaxtrain import storage
from jaxtrain.errors import ConfigError


def test_atomic_write_and_read_back(bucket, tmp_path):
    for root in (storage.as_path(bucket), storage.as_path(str(tmp_path))):
        path = root / "run" / "config.json"
        if not storage.is_remote(path):
            path.parent.mkdir(parents=True)
        storage.write_json(path, {"a": 1})
        assert path.read_text() == '{"a": 1}\n'
        storage.atomic_write(path, b"x")
        assert path.read_bytes() == b"x"
        assert [p.name for p in path.parent.iterdir()] == ["config.json"]


@pytest.mark.parametrize("value, message", [
    ("ftp://host/x", "--workdir=ftp://host/x: ftp:// is not a storage jaxtrain reads or "
                     "writes; use a local path, gs://, s3://"),
    (3, "--workdir=3 is not a path"),
])
def test_bad_paths_are_one_line(value, message):
    with pytest.raises(ConfigError) as e:
        storage.as_path(value, "--workdir")
    assert str(e.value) == message
