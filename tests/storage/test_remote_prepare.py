"""jaxtrain prepare with object storage (jaxtrain/prepare/remote.py), against the real S3 and
GCS servers the `bucket` fixture starts: inputs and --out on gs:// and s3://, parts
uploaded and merged there, an interrupted upload, and one-line user errors."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxtrain import storage
from jaxtrain.commands import prepare as command
from jaxtrain.errors import DataError
from jaxtrain.prepare import pipeline as P
from jaxtrain.prepare.merge import merge

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAST = ["--tokenizer", "bytes", "--processes", "1", "--no-progress"]


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A directory of text files and a JSON Lines file; scratch (staging, the input cache)
    under tmp_path."""
    monkeypatch.setenv("JAXTRAIN_SCRATCH", str(tmp_path / "scratch"))
    root = tmp_path / "in"
    (root / "text").mkdir(parents=True)
    for i in range(6):
        (root / "text" / f"{i}.txt").write_text(f"document {i} " + "words " * (30 * i + 5))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n"
                                             for i in range(8)))
    return root


def _remote_files(url: str) -> dict[str, bytes]:
    fs, root = storage.filesystem(url)
    fs.invalidate_cache()
    return {name[len(root) + 1:]: fs.cat_file(name) for name in sorted(fs.find(root))}


def _local_files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_prepare_to_object_storage_writes_a_local_prepares_files(bucket, corpus, tmp_path,
                                                                 capsys):
    assert command.main([str(corpus), "--out", str(tmp_path / "local"), *FAST]) == 0
    out = f"{bucket}/data"
    assert command.main([str(corpus), "--out", out, *FAST]) == 0
    assert _remote_files(out) == _local_files(tmp_path / "local")  # the manifest included
    assert not any((tmp_path / "scratch").glob("*-prepare")), "the local stand-in is gone"
    capsys.readouterr()
    assert command.main([str(corpus), "--out", out, *FAST]) == 0  # already there: kept
    assert "is already prepared" in capsys.readouterr().err
    # Other inputs: refused without --overwrite, as on disk; with it, nothing old stays.
    assert command.main([str(corpus / "text"), "--out", out, *FAST]) == 2
    assert "already holds a dataset prepared from other inputs" in capsys.readouterr().err
    assert command.main([str(corpus / "text"), "--out", out, "--overwrite", *FAST]) == 0
    assert command.main([str(corpus / "text"), "--out", str(tmp_path / "text"), *FAST]) == 0
    assert _remote_files(out) == _local_files(tmp_path / "text")


def test_parts_uploaded_then_merged_on_object_storage(bucket, corpus, tmp_path):
    options = dict(tokenizer="bytes", progress=False, processes=1, unit_bytes=200)
    single = P.prepare(P.Request.build([str(corpus)], str(tmp_path / "single"), **options))
    out = f"{bucket}/parts"
    P.prepare(P.Request.build([str(corpus)], out, shard=(0, 2), **options))
    with pytest.raises(DataError, match=r"^--merge=.*: 1 of 2 parts are not finished \(first: "
                                        r"part-00001-of-00002\); run their prepare first$"):
        merge(out)
    P.prepare(P.Request.build([str(corpus)], out, shard=(1, 2), **options))
    merged = merge(out)
    assert merged["fingerprint"] == single["fingerprint"]
    for i in range(2):  # the same parts, locally, merge to the same manifest
        P.prepare(P.Request.build([str(corpus)], str(tmp_path / "local"), shard=(i, 2), **options))
    assert merge(tmp_path / "local") == merged
    assert _remote_files(out) == _local_files(tmp_path / "local")  # tokens not copied


def test_an_interrupted_upload_is_not_a_dataset_and_a_rerun_finishes_it(
        bucket, corpus, tmp_path, monkeypatch, capsys):
    out = f"{bucket}/data"
    copy = storage.copy_file

    def killed_before_the_manifest(fs, source, target, upload, progress=None):
        if target.endswith("/manifest.json"):
            raise KeyboardInterrupt
        copy(fs, source, target, upload, progress)

    monkeypatch.setattr(storage, "copy_file", killed_before_the_manifest)
    assert command.main([str(corpus), "--out", out, *FAST]) == 130
    names = _remote_files(out)
    assert "tokens-00000.bin" in names and "manifest.json" not in names
    monkeypatch.setattr(storage, "copy_file", copy)
    capsys.readouterr()
    assert command.main([str(corpus), "--out", out, *FAST]) == 0  # uploaded, not prepared
    assert "holds this dataset, prepared; committing it to" in capsys.readouterr().err
    assert command.main([str(corpus), "--out", str(tmp_path / "local"), *FAST]) == 0
    assert _remote_files(out) == _local_files(tmp_path / "local")


def test_inputs_on_object_storage_are_named_by_their_urls(bucket, corpus, tmp_path,
                                                          monkeypatch):
    storage.upload_tree(corpus, storage.as_path(f"{bucket}/in"))
    local = P.prepare(P.Request.build([str(corpus)], str(tmp_path / "local"), tokenizer="bytes",
                                      progress=False, processes=1))
    urls = [f"{bucket}/in/{s['path'][len(str(corpus)) + 1:]}" for s in local["sources"]]
    for i, inputs in enumerate([[f"{bucket}/in"],  # a prefix, an object and a glob
                                [f"{bucket}/in/docs.jsonl", f"{bucket}/in/text/*.txt"]]):
        made = P.prepare(P.Request.build(inputs, str(tmp_path / f"out{i}"), tokenizer="bytes",
                                         progress=False, processes=1))
        assert made["fingerprint"] == local["fingerprint"]
        assert [s["path"] for s in made["sources"]] == urls
    fetched = []
    monkeypatch.setattr(storage, "copy_file", lambda *a, **k: fetched.append(a))
    P.prepare(P.Request.build([f"{bucket}/in"], str(tmp_path / "again"), tokenizer="bytes",
                              progress=False, processes=1))
    assert not fetched, "unchanged objects come from the cache"


@pytest.mark.parametrize("argv, key", [
    (["IN", "--out", "URL"], "--out"),
    (["URL", "--out", "OUT"], "input"),
    (["--merge", "URL"], "--merge"),
])
def test_a_missing_bucket_is_one_line(bucket, corpus, tmp_path, capsys, argv, key):
    url = f"{storage.scheme_of(bucket)}://no-such-bucket-jt/data"
    argv = [{"IN": str(corpus), "OUT": str(tmp_path / "out"), "URL": url}.get(a, a)
            for a in argv]
    assert command.main(argv + FAST) == 2
    assert capsys.readouterr().err == (f"jaxtrain: error: {key}={url}: bucket "
                                       "no-such-bucket-jt does not exist\n")
    assert not (tmp_path / "out").exists()


def test_a_prefix_holding_other_objects_is_never_replaced(bucket, corpus, capsys):
    storage.as_path(f"{bucket}/data/notes.txt").write_text("mine")
    assert command.main([str(corpus), "--out", f"{bucket}/data", "--overwrite", *FAST]) == 2
    err = capsys.readouterr().err
    assert "holds files that are not a prepared dataset (first: notes.txt)" in err
    assert list(_remote_files(f"{bucket}/data")) == ["notes.txt"]


def test_a_trained_tokenizer_alone_to_object_storage(bucket, corpus, tmp_path):
    train = [str(corpus), "--train-tokenizer", "300", "--tokenizer-only", "--no-progress",
             "--processes", "1"]
    assert command.main([*train, "--out", str(tmp_path / "tok")]) == 0
    assert command.main([*train, "--out", f"{bucket}/tok"]) == 0
    assert _remote_files(f"{bucket}/tok") == _local_files(tmp_path / "tok")


@pytest.mark.slow  # a CLI subprocess: the clients configured from the environment alone
def test_the_command_uploads_with_a_progress_bar(bucket, corpus, tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxtrain.commands.prepare", str(corpus),
                          "--out", f"{bucket}/data", "--tokenizer", "bytes", "--processes", "1"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "upload: 100%" in out.stderr and f"wrote {bucket}/data" in out.stderr
    assert "manifest.json" in _remote_files(f"{bucket}/data")


def test_a_saved_hf_dataset_on_object_storage_is_fetched_not_streamed(bucket, corpus, tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"row {i} " * (i + 3) for i in range(12)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    storage.upload_tree(tmp_path / "hf", storage.as_path(f"{bucket}/hf"))
    options = dict(tokenizer="bytes", progress=False, processes=1)
    local = P.prepare(P.Request.build([], str(tmp_path / "a"), hf_dataset=str(tmp_path / "hf"),
                                      **options))
    fetched = P.prepare(P.Request.build([], str(tmp_path / "b"), hf_dataset=f"{bucket}/hf",
                                        **options))
    assert fetched["fingerprint"] == local["fingerprint"]
    assert fetched["sources"][0]["path"] == f"{bucket}/hf"


def test_a_tokenizer_on_object_storage_is_read_like_a_local_one(bucket, corpus, tmp_path):
    train = [str(corpus), "--train-tokenizer", "300", "--tokenizer-only", "--no-progress",
             "--processes", "1"]
    assert command.main([*train, "--out", str(tmp_path / "tok")]) == 0
    storage.upload_tree(tmp_path / "tok", storage.as_path(f"{bucket}/tok"))
    options = ["--no-progress", "--processes", "1"]
    assert command.main([str(corpus), "--out", str(tmp_path / "a"), "--tokenizer",
                         str(tmp_path / "tok"), *options]) == 0
    assert command.main([str(corpus), "--out", str(tmp_path / "b"), "--tokenizer",
                         f"{bucket}/tok", *options]) == 0
    fingerprint = [json.loads((tmp_path / d / "manifest.json").read_text())["fingerprint"]
                   for d in "ab"]
    assert fingerprint[0] == fingerprint[1]
