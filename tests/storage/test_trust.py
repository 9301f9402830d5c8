"""A workdir, a dataset, a bucket or a model directory from someone else cannot make jaxtrain
write or read a file outside it: every name read from a manifest, a listing or a bucket goes
through storage.contained, and is refused in one line before anything is written. And a
prepared shard is checked against the sha256 its manifest records, once per shard (docs/
operations.md, "Trust"). Hostile names for every reader: checkpoints (local and in the
bucket: the real S3 and GCS servers), datasets (shards, indexes, masks, mixtures),
tokenizers and prepare's inputs (bucket listings), Hugging Face imports (weight_map)."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import object_server, small_config
from safetensors.numpy import save_file
from test_prepared_data import LOWER, _letters, _prepare
from test_remote_checkpoints import _on_host, _open, _save, _target

from jaxtrain import storage
from jaxtrain.checkpoint import Checkpoints, file_checksum
from jaxtrain.data import shard_check
from jaxtrain.data.batches import make_batches
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.errors import CheckpointError, ConfigError, DataError
from jaxtrain.hf.files import SafetensorsDir

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_contained_takes_names_inside_and_refuses_the_rest(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    assert storage.contained(root, "a/b.bin", "x") == root / "a" / "b.bin"
    for name in ("/etc/passwd", "../x", "a/../../x", "a/..", "..", "", None, 3, "a\0b"):
        with pytest.raises(DataError, match=r"^the listing names .*refused$"):
            storage.contained(root, name, "the listing")
    with pytest.raises(CheckpointError, match="'../x'"):
        storage.contained(root, "../x", "a manifest", CheckpointError)
    (root / "out").symlink_to(tmp_path)  # a link already there that leads out
    with pytest.raises(DataError, match=r"'out/secret', which leads out of .*symbolic link"):
        storage.contained(root, "out/secret", "x")
    assert storage.contained(root, "out/secret", "x", links=True) == root / "out" / "secret"
    # A URL's names are checked as names (a bucket has no links).
    assert str(storage.contained(storage.as_path("s3://b/p"), "k/v", "x")) == "s3://b/p/k/v"
    with pytest.raises(DataError):
        storage.contained(storage.as_path("s3://b/p"), "k/../../v", "x")


# --- checkpoints --------------------------------------------------------------------------

def test_a_bucket_step_whose_index_names_objects_outside_is_refused(bucket, tmp_path,
                                                                    monkeypatch):
    """A committed step 20 copied to step 30, whose index (checkpoint_shards) names an
    absolute path and a '../' key as the parts its pieces lie in. A reader (eval, generate)
    and a resuming run refuse it in one line, before reading a piece; nothing is set aside,
    and nothing is written on the host's disk (a step is read in place)."""
    _on_host(monkeypatch, tmp_path, "a")
    writer = _open(bucket)
    _save(writer, 20)
    writer.close()
    source = storage.kvstore(f"{bucket}/run/checkpoints/20")
    copy = storage.kvstore(f"{bucket}/run/checkpoints/30")
    for name in storage.kv_keys(f"{bucket}/run/checkpoints/20"):
        copy.write(name, source.read(name).result().value).result()
    index = json.loads(copy.read("state.p0.json").result().value)
    index["pieces"][0][2] = "../../../pwned.bin"
    index["pieces"][1][2] = str(tmp_path / "pwned.bin")
    copy.write("state.p0.json", json.dumps(index).encode()).result()

    _on_host(monkeypatch, tmp_path, "b")
    reader = _open(bucket, read_only=True)
    assert reader.steps() == [20, 30]
    with pytest.raises(CheckpointError, match=r"names '.*pwned.bin' as a part: not one of "
                                              r"the step's"):
        reader.restore(30, _target())
    reader.close()
    resumed = _open(bucket)
    with pytest.raises(CheckpointError, match="pwned"):
        resumed.newest_intact(_target(), lambda *_: None)
    resumed.close()
    assert storage.AtomicSet.committed(f"{bucket}/run/checkpoints/30"), "refused, not set aside"
    assert not [p for p in (tmp_path / "b").rglob("*") if p.is_file()]


def test_a_local_manifest_naming_a_file_outside_is_refused(tmp_path):
    checkpoints = Checkpoints(tmp_path / "run" / "checkpoints", keep=3)
    _save(checkpoints, 1)
    checkpoints.close()
    secret = tmp_path / "secret.txt"
    secret.write_text("not the checkpoint's")
    path = tmp_path / "run" / "checkpoint_manifests" / "1.json"
    manifest = json.loads(path.read_text())
    manifest["files"]["../../secret.txt"] = [secret.stat().st_size, file_checksum(secret)]
    path.write_text(json.dumps(manifest))
    reader = Checkpoints(tmp_path / "run" / "checkpoints", keep=3, read_only=True)
    with pytest.raises(CheckpointError, match=r"'\.\./\.\./secret\.txt'"):
        reader.latest_intact()
    reader.manager.close()


# --- datasets -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small prepared dataset (bytes tokenizer); each test edits a copy."""
    return pathlib.Path(_prepare(tmp_path_factory.mktemp("trust"), "ds", _letters(LOWER, 80)))


def _copy(dataset, tmp_path, name: str = "ds") -> pathlib.Path:
    return pathlib.Path(shutil.copytree(dataset, tmp_path / name))


def _edit_shard(ds: pathlib.Path, **entry) -> None:
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["shards"][0].update(entry)
    (ds / "manifest.json").write_text(json.dumps(manifest))


def _cfg(**overrides):
    return small_config(**{"data.source": "prepared", "eval_batches": 1, **overrides})


@pytest.mark.parametrize("key", ["tokens", "index", "mask"])
def test_a_dataset_manifest_naming_a_file_outside_the_dataset_is_refused(dataset, tmp_path,
                                                                         key):
    """The issue's repro (shards[0].tokens = '../../secret.txt', num_tokens its size), and
    the same for the document index, a chat dataset's mask, an absolute name and a mixture
    member: refused when the dataset is opened, before anything is read."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"password=hunter2\n" * 64)
    ds = _copy(dataset, tmp_path / "data")
    for name in ("../../secret.txt", str(secret)):
        _edit_shard(ds, **{key: name, "num_tokens": secret.stat().st_size})
        with pytest.raises(DataError, match=re.escape(
                f"data.path={ds}: manifest.json (shard 0's '{key}') names '{name}', which is "
                "not a file")):
            make_batches(_cfg(**{"data.path": str(ds)}))
    good = _copy(dataset, tmp_path, "good")
    with pytest.raises(DataError, match=re.escape(f"data.mixture entry {ds}={ds}: ") +
                       f".*names '{re.escape(str(secret))}'"):
        make_batches(_cfg(**{"data.mixture": f"{good}:0.5,{ds}:0.5"}))


def test_a_shard_that_links_out_of_the_dataset_is_refused(dataset, tmp_path):
    secret = tmp_path / "secret.txt"
    ds = _copy(dataset, tmp_path / "data")
    shard = ds / "tokens-00000.bin"
    shutil.copyfile(shard, secret)
    shard.unlink()
    shard.symlink_to(secret)
    with pytest.raises(DataError, match="leads out of .*symbolic link"):
        PreparedDataset(ds)


def test_a_shard_is_checked_against_its_sha256_once(dataset, tmp_path, monkeypatch):
    """A changed byte is found where the shard is first read; an intact shard is hashed once
    per process, and once per host while it is unchanged (the verdict on scratch)."""
    monkeypatch.setenv("JAXTRAIN_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(shard_check, "_verified", set())
    ds = _copy(dataset, tmp_path)
    hashed = []
    real = shard_check.sha256_of
    monkeypatch.setattr(shard_check, "sha256_of", lambda *a: hashed.append(a) or real(*a))
    for _ in range(2):  # two opens in one process: one hash
        opened = PreparedDataset(ds)
        opened.read(0, 10)
        opened.read(5, 20)
    assert len(hashed) == 1
    monkeypatch.setattr(shard_check, "_verified", set())  # another process on this host
    PreparedDataset(ds).read(0, 10)
    assert len(hashed) == 1

    shard = ds / "tokens-00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit, same size
    shard.write_bytes(bytes(data))
    stat = shard.stat()  # a replaced file's new modification time (on any clock resolution)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match=re.escape(f"data.path={ds}: shard ") +
                       r".*tokens-00000.bin does not match its manifest \(sha256 [0-9a-f]{12}, recorded"):
        PreparedDataset(ds).read(0, 10)


# --- bucket listings: a remote dataset's tokenizer, prepare's inputs ----------------------

def test_a_bucket_listing_with_a_key_leading_out_writes_nothing(dataset, tmp_path,
                                                                monkeypatch):
    """An object `ds/tokenizer/../../../pwned.txt` (S3 keeps such keys; GCS folds them) in a
    dataset's tokenizer folder, and one among prepare's inputs: refused before any copy."""
    from jaxtrain.prepare import remote

    monkeypatch.setenv("JAXTRAIN_SCRATCH", str(tmp_path / "scratch"))
    bucket = object_server("s3").bucket()
    storage.upload_tree(dataset, f"{bucket}/ds", last="manifest.json")
    fs, root = storage.filesystem(f"{bucket}/ds")
    # The tokenizer is copied to tmp/scratch/<hash>-copy/.partial-*: three levels up is tmp.
    fs.pipe_file(f"{root}/tokenizer/../../../pwned.txt", b"evil")
    with pytest.raises(DataError, match=r"the listing of s3://.*/ds/tokenizer names "
                                        r"'\.\./\.\./\.\./pwned\.txt'"):
        PreparedDataset(f"{bucket}/ds").tokenizer()
    inputs = storage.filesystem(f"{bucket}/in")[1]
    fs.pipe_file(f"{inputs}/a.txt", b"text")
    fs.pipe_file(f"{inputs}/../../../pwned.txt", b"evil")
    with pytest.raises(DataError, match=r"input s3://.*/in names '\.\./\.\./\.\./pwned\.txt'"):
        remote.fetch_inputs([f"{bucket}/in"], False)
    assert not list(tmp_path.rglob("pwned.txt"))


# --- Hugging Face imports -----------------------------------------------------------------

def test_a_safetensors_index_naming_a_file_outside_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"wte.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "outside.safetensors"))
    for name in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        (model / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"wte.weight": name}}))
        with pytest.raises(ConfigError, match=re.escape(
                f"--from-hf={model}: model.safetensors.index.json's weight_map names "
                f"'{name}'")):
            SafetensorsDir(model)
    # The Hub's cache links a snapshot's files to blobs beside it: that is followed.
    (model / "model.safetensors.index.json").unlink()
    (model / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with SafetensorsDir(model) as files:
        assert files.shape("wte.weight") == (2, 2)


# --- one command, end to end --------------------------------------------------------------

@pytest.mark.slow
def test_train_on_a_hostile_dataset_exits_2_and_writes_nothing(dataset, tmp_path):
    ds = _copy(dataset, tmp_path)
    _edit_shard(ds, tokens="../../secret.txt")
    workdir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config", "configs/tiny.py",
                          "--config.data.source=prepared", f"--config.data.path={ds}",
                          f"--workdir={workdir}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"jaxtrain: error: data.path={ds}: manifest.json (shard 0's 'tokens') names "
        f"'../../secret.txt', which is not a file inside {ds}: a name there must be a "
        "relative path without '..'; refused"]
    assert not workdir.exists()
