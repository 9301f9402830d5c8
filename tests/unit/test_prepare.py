"""jaxtrain prepare: inputs to token shards, deterministic, resumable, never half-readable."""

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxtrain.commands import prepare as command
from jaxtrain.data import fingerprints
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.data.tokenizers import load_tokenizer
from jaxtrain.errors import DataError
from jaxtrain.prepare import pipeline as P
from jaxtrain.prepare.merge import merge


def _texts(n: int = 24) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "λ", "naïve", "🙂", "def", "return", "x"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 400)))) + "\n"
            for _ in range(n)]


@pytest.fixture
def corpus(tmp_path):
    """Text files (one document each) and a JSON Lines file, in a directory."""
    root = tmp_path / "in"
    (root / "text").mkdir(parents=True)
    texts = _texts()
    for i, text in enumerate(texts[:12]):
        (root / "text" / f"{i:02d}.txt").write_text(text)
    with open(root / "docs.jsonl", "w") as f:
        for text in texts[12:]:
            f.write(json.dumps({"text": text, "id": 1}) + "\n")
    return root, texts


def _request(inputs, out, **more) -> P.Request:
    return P.Request.build(inputs=[str(i) for i in inputs], out=str(out),
                           **{"tokenizer": "bytes", "progress": False, "processes": 1, **more})


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


def _documents(path) -> list[bytes]:
    ds = PreparedDataset(path)
    return [ds.read(*ds.document(i)).astype(np.uint8).tobytes()
            for i in range(ds.num_documents)]


def test_same_inputs_same_bytes_however_many_processes(corpus, tmp_path):
    root, texts = corpus
    small = {"unit_bytes": 2000, "tokens_per_file": 3000}  # many units, several shards
    one = P.prepare(_request([root / "text", root / "docs.jsonl"], tmp_path / "one", **small))
    two = P.prepare(_request([root / "text", root / "docs.jsonl"], tmp_path / "two",
                             processes=2, **small))
    assert len(one["shards"]) > 2
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    assert one["fingerprint"] == two["fingerprint"]
    # Every document comes back whole and in input order (files sorted, then JSON lines).
    assert _documents(tmp_path / "one") == [t.encode() for t in texts]
    assert one["num_documents"] == len(texts)
    assert one["text_bytes"] == sum(len(t.encode()) for t in texts)


def test_policy_adds_eos_between_documents_of_a_trained_bpe(corpus, tmp_path):
    root, texts = corpus
    manifest = P.prepare(_request([root / "text"], tmp_path / "out", tokenizer=None,
                                  train_tokenizer=300))
    ds = PreparedDataset(tmp_path / "out")
    tokenizer = ds.tokenizer()
    assert tokenizer.fingerprint() == manifest["tokenizer"]["fingerprint"]
    assert manifest["policy"] == {"bos": False, "bos_id": None, "eos": True, "eos_id": 0}
    assert manifest["dtype"] == "uint16"
    for i in range(ds.num_documents):
        ids = ds.read(*ds.document(i))
        assert ids[-1] == tokenizer.eos_id and tokenizer.eos_id not in ids[:-1]
        assert tokenizer.decode(ids[:-1]) == texts[i]
    # GPT-2 style, BOS = EOS: auto adds only the EOS; --bos yes adds both.
    gpt2_style = tmp_path / "gpt2_style"
    tokenizer.save(gpt2_style)
    meta = json.loads((gpt2_style / "jaxtrain_tokenizer.json").read_text())
    (gpt2_style / "jaxtrain_tokenizer.json").write_text(json.dumps({**meta, "bos_id": 0}))
    auto = P.prepare(_request([root / "text"], tmp_path / "auto", tokenizer=str(gpt2_style)))
    assert (auto["policy"]["bos"], auto["policy"]["eos"]) == (False, True)
    both = P.prepare(_request([root / "text"], tmp_path / "both", tokenizer=str(gpt2_style),
                              bos="yes"))
    ids = PreparedDataset(tmp_path / "both").read(*PreparedDataset(tmp_path / "both")
                                                  .document(0))
    assert both["policy"]["bos"] and ids[0] == 0 and ids[-1] == 0


def test_bad_records_are_skipped_counted_and_located(tmp_path):
    lines = [json.dumps({"text": "good one"}), "{not json", json.dumps({"other": 1}),
             json.dumps({"text": 3}), json.dumps({"text": ""}), "", json.dumps({"text": None}),
             json.dumps({"text": "good two"})]
    path = tmp_path / "bad.jsonl"
    raw = ("\n".join(lines) + "\n").encode() + b'{"text": "caf\xe9 latin-1"}\n'
    path.write_bytes(raw * 3)
    manifest = P.prepare(_request([path], tmp_path / "out", unit_bytes=100,
                                  max_bad_fraction=0.9))
    report = manifest["report"]
    skipped = {k: v["count"] for k, v in report["skipped"].items()}
    assert skipped == {"malformed_json": 3, "missing_field": 6, "not_text": 3, "empty": 3,
                       "hidden_files": 0, "binary_files": 0}
    # Line numbers count across the units a file was cut into (8 lines per copy + 1).
    assert report["skipped"]["malformed_json"]["first"] == [f"{path}:2", f"{path}:11",
                                                            f"{path}:20"]
    assert report["skipped"]["missing_field"]["first"][:2] == [f"{path}:3", f"{path}:7"]
    assert report["invalid_utf8_replaced"] == {"count": 3, "first": [
        f"{path}:9", f"{path}:18", f"{path}:27"]}
    assert report["records"] == 8 * 3 and report["documents"] == 9
    assert _documents(tmp_path / "out")[:3] == [b"good one", b"good two",
                                                "caf\ufffd latin-1".encode()]


def test_too_many_bad_records_abort_with_the_first_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([json.dumps({"text": "ok"})] * 5 + ["{broken"] * 5) + "\n")
    with pytest.raises(DataError, match=rf"5 of 10 records were unusable \(50.00%, over "
                                        rf"--max-bad-fraction=0.1\).*first: {path}:6"):
        P.prepare(_request([path], tmp_path / "out", max_bad_fraction=0.1))
    assert not (tmp_path / "out").exists()
    code = command.main([str(path), "--out", str(tmp_path / "out"), "--tokenizer", "bytes",
                         "--no-progress", "--max-bad-fraction", "0.1"])
    assert code == 2


def test_parquet_and_saved_hugging_face_datasets(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    texts = _texts(10)
    column = texts[:5] + [None] + texts[5:]
    pq.write_table(pa.table({"body": column}), tmp_path / "t.parquet", row_group_size=3)
    manifest = P.prepare(_request([tmp_path / "t.parquet"], tmp_path / "pq", field="body",
                                  unit_bytes=200, max_bad_fraction=0.5))
    assert _documents(tmp_path / "pq") == [t.encode() for t in texts]
    assert manifest["report"]["skipped"]["missing_field"] == {
        "count": 1, "first": [f"{tmp_path / 't.parquet'} row 6"]}
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "hf"))
    P.prepare(_request([tmp_path / "hf"], tmp_path / "hf_out", field="body", unit_bytes=500))
    assert _documents(tmp_path / "hf_out") == [t.encode() for t in texts]
    with pytest.raises(DataError, match="no column 'text' \\(--field\\); its columns are body"):
        P.prepare(_request([tmp_path / "t.parquet"], tmp_path / "x"))
    # --shard: row groups and rows lie at their share of their file's bytes.
    both, options = [tmp_path / "t.parquet", tmp_path / "hf"], {
        "field": "body", "unit_bytes": 200, "max_bad_fraction": 0.5}
    parts = [P.prepare(_request(both, tmp_path / "parts", shard=(i, 3), **options))
             for i in range(3)]
    assert all(part["num_documents"] for part in parts)
    single = P.prepare(_request(both, tmp_path / "single", **options))
    assert merge(tmp_path / "parts")["fingerprint"] == single["fingerprint"]
    assert _documents(tmp_path / "parts") == _documents(tmp_path / "single")


def test_streamed_hugging_face_dataset(tmp_path):
    pytest.importorskip("datasets")
    texts = _texts(8)
    (tmp_path / "stream").mkdir()
    with open(tmp_path / "stream" / "part.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    request = _request([], tmp_path / "out", hf_dataset=str(tmp_path / "stream"),
                       unit_bytes=300, processes=2)
    P.prepare(request)
    assert _documents(tmp_path / "out") == [t.encode() for t in texts]


class _Crash(BaseException):
    """A kill or Ctrl-C: no `except Exception` sees it, so no failure is recorded."""


def test_interrupted_prepare_resumes_to_the_same_bytes(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    small = {"unit_bytes": 1500, "tokens_per_file": 2500}
    reference = P.prepare(_request([root], tmp_path / "ref", **small))
    commit = P.ShardWriter.commit
    calls = []

    def crash_on_third(self, report):
        calls.append(self.index)
        if len(calls) == 3:
            raise _Crash()
        return commit(self, report)

    monkeypatch.setattr(P.ShardWriter, "commit", crash_on_third)
    with pytest.raises(_Crash):
        P.prepare(_request([root], tmp_path / "out", **small))
    with pytest.raises(DataError, match=r"is not a prepared dataset \(no manifest.json\); "
                                        r".*out.partial holds an unfinished prepare"):
        PreparedDataset(tmp_path / "out")
    monkeypatch.setattr(P.ShardWriter, "commit", commit)
    # A shard record from a jaxtrain without stream hashes is redone, not trusted.
    old = tmp_path / "out.partial" / "shard-00001.json"
    old.write_text(json.dumps({k: v for k, v in json.loads(old.read_text()).items()
                               if k != "stream"}))
    resumed = []
    monkeypatch.setattr(P.workers, "work_unit",
                        lambda unit, f=P.workers.work_unit: resumed.append(unit) or f(unit))
    P.prepare(_request([root], tmp_path / "out", **small))
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")
    assert 0 < len(resumed) < len(P.layout_inputs(_request([root], tmp_path / "x",
                                                       **small)).units)
    # Once complete, the same command has nothing to do.
    again = P.prepare(_request([root], tmp_path / "out", **small))
    assert again == reference


def test_out_of_disk_keeps_the_previous_dataset(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    old = P.prepare(_request([root], tmp_path / "out"))
    add = P.ShardWriter.add

    def disk_full(self, unit_index, result):
        if unit_index > 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return add(self, unit_index, result)

    monkeypatch.setattr(P.ShardWriter, "add", disk_full)
    with pytest.raises(DataError, match=r"out of disk space writing .*out.partial: the "
                                        r"previous dataset at .*out is intact"):
        P.prepare(_request([root], tmp_path / "out", unit_bytes=1000, eos="no",
                           overwrite=True))
    assert PreparedDataset(tmp_path / "out").fingerprint == old["fingerprint"]
    assert not list((tmp_path / "out.partial").glob("*.tmp"))


def test_shards_on_many_machines_merge_into_the_same_stream(corpus, tmp_path):
    root, texts = corpus
    for i in range(3):
        P.prepare(_request([root], tmp_path / "many", shard=(i, 3), unit_bytes=1000))
    assert command.main(["--merge", str(tmp_path / "many")]) == 0
    P.prepare(_request([root], tmp_path / "single", unit_bytes=1000))
    merged, single = PreparedDataset(tmp_path / "many"), PreparedDataset(tmp_path / "single")
    assert merged.num_tokens == single.num_tokens
    np.testing.assert_array_equal(merged.read(0, merged.num_tokens),
                                  single.read(0, single.num_tokens))
    assert _documents(tmp_path / "many") == _documents(tmp_path / "single")
    assert merged.manifest["num_documents"] == len(texts)
    assert merged.tokenizer().kind == "bytes"
    # The same content, so the same fingerprint: a run resumes on either copy.
    assert merged.fingerprint == single.fingerprint


def test_stream_hash_joins_over_any_cut():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 1 << 32, size=70_001, dtype=np.uint64).astype(np.uint32)
    whole = fingerprints.stream_hash(values)
    cuts = [0, 5, 32_768, 32_769, 50_000, 70_001]  # across the hash's 2^15-value chunks
    pieces = [(fingerprints.stream_hash(values[a:b]), b - a) for a, b in zip(cuts, cuts[1:])]
    assert fingerprints.join_stream_hashes(pieces) == whole
    # H(s) = sum_j s_j r^(n-1-j) mod p, for each (r, p); checked against Python integers.
    expected = []
    for r, p in zip(fingerprints._BASES, fingerprints._PRIMES):
        h = 0
        for v in values[:40_000].tolist():
            h = (h * r + v) % p
        expected.append(f"{h:08x}")
    assert fingerprints.stream_hash(values[:40_000]) == "".join(expected)
    assert fingerprints.stream_hash(values[:-1]) != whole
    assert fingerprints.stream_hash(values.astype(np.uint64)) == whole  # any integer dtype


def _skewed(root: pathlib.Path) -> tuple[list[pathlib.Path], list[str]]:
    """Four JSON Lines files, the first 30 times the size of each other one."""
    root.mkdir()
    texts = [f"document {k} " + "word " * (k % 7) for k in range(33 * 8)]
    paths, k = [], 0
    for name, count in (("big", 240), ("b", 8), ("c", 8), ("d", 8)):
        lines = [json.dumps({"text": t}) for t in texts[k:k + count]]
        if name == "big":
            lines[150] = "{broken"  # in the part that starts inside this file
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        paths.append(root / f"{name}.jsonl")
        k += count
    return paths, texts


def test_shards_cut_inside_a_big_file_and_merge_to_the_one_shot_fingerprint(tmp_path):
    paths, texts = _skewed(tmp_path / "in")
    options = {"unit_bytes": 2000, "max_bad_fraction": 0.5}
    parts = [P.prepare(_request(paths, tmp_path / "many", shard=(i, 3), **options))
             for i in range(3)]
    assert all(part["num_documents"] > 0 for part in parts)  # no part is left empty
    assert sum(part["num_documents"] for part in parts) == len(texts) - 1
    merged = merge(tmp_path / "many")
    single = P.prepare(_request(paths, tmp_path / "single", **options))
    assert merged["fingerprint"] == single["fingerprint"]
    assert _documents(tmp_path / "many") == _documents(tmp_path / "single")
    assert _documents(tmp_path / "single") == [t.encode() for k, t in enumerate(texts)
                                               if k != 150]
    assert merged["sources"] == single["sources"]
    # A bad line in a part that starts inside the file keeps its line number in the file.
    where = f"{paths[0]}:151"
    assert merged["report"]["skipped"]["malformed_json"]["first"] == [where]
    assert single["report"]["skipped"]["malformed_json"]["first"] == [where]
    # The fingerprint is the content's: shard sizes and unit sizes do not change it.
    other = P.prepare(_request(paths, tmp_path / "other", unit_bytes=700, tokens_per_file=900,
                               max_bad_fraction=0.5))
    assert len(other["shards"]) > len(single["shards"])
    assert other["fingerprint"] == single["fingerprint"]


def test_a_part_inside_one_whole_file_document_is_empty_and_merges(tmp_path):
    (tmp_path / "in").mkdir()
    texts = ["big " * 3000, "small one", "small two", "small three"]
    for k, text in enumerate(texts):
        (tmp_path / "in" / f"{k}.txt").write_text(text)
    parts = [P.prepare(_request([tmp_path / "in"], tmp_path / "many", shard=(i, 3)))
             for i in range(3)]
    assert [part["num_documents"] for part in parts] == [1, 0, 3]
    merged = merge(tmp_path / "many")
    single = P.prepare(_request([tmp_path / "in"], tmp_path / "single"))
    assert merged["fingerprint"] == single["fingerprint"]
    assert _documents(tmp_path / "many") == [t.encode() for t in texts]


def test_merge_refuses_missing_or_mismatched_parts(corpus, tmp_path):
    root, _ = corpus
    P.prepare(_request([root], tmp_path / "m", shard=(0, 2)))
    with pytest.raises(DataError, match="1 of 2 parts are not finished .first: "
                                        "part-00001-of-00002"):
        merge(tmp_path / "m")
    P.prepare(_request([root], tmp_path / "tok", tokenizer=None, train_tokenizer=300,
                       tokenizer_only=True))
    P.prepare(_request([root], tmp_path / "m", shard=(1, 2), tokenizer=str(tmp_path / "tok")))
    with pytest.raises(DataError, match="part 1 was prepared with tokenizer [0-9a-f]{12}, "
                                        "part 0 with [0-9a-f]{12}"):
        merge(tmp_path / "m")
    P.prepare(_request([root / "text"], tmp_path / "m", shard=(1, 2), overwrite=True))
    with pytest.raises(DataError, match="part 1 was prepared from other inputs than part 0 "
                                        r"\(first difference: "):
        merge(tmp_path / "m")
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_command_line_errors_are_one_line(corpus, tmp_path, capsys):
    root, _ = corpus
    cases = [([str(root)], "--out DIR is required"),
             ([str(root), "--out", str(tmp_path / "o")], "give one of --tokenizer"),
             ([str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), "--tokenizer", "bytes"],
              "no such file"),
             ([str(root), "--out", str(root), "--tokenizer", "bytes"],
              "holds files that are not a prepared dataset (first: docs.jsonl)"),
             ([str(root), "--out", str(tmp_path / "o"), "--tokenizer", "bytes", "--shard",
               "3/2"], "--shard=3/2 is invalid"),
             ([str(root), "--out", str(tmp_path / "o"), "--tokenizer", "bytes", "--eos",
               "yes"], "--eos=yes: the tokenizer (bytes (UTF-8, 256 ids)) has no EOS token")]
    for argv, message in cases:
        assert command.main(argv + ["--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and err[-1].startswith("jaxtrain: error: "), err


def test_tokenizer_only_then_shared_by_every_part(corpus, tmp_path):
    root, texts = corpus
    assert command.main([str(root), "--out", str(tmp_path / "tok"), "--train-tokenizer", "300",
                         "--tokenizer-only", "--no-progress"]) == 0
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert 256 < tokenizer.vocab_size <= 300  # a tiny corpus has fewer merges to learn
    for i in range(2):
        assert command.main([str(root), "--out", str(tmp_path / "ds"), "--tokenizer",
                             str(tmp_path / "tok"), "--shard", f"{i}/2", "--no-progress"]) == 0
    merge(tmp_path / "ds")
    ds = PreparedDataset(tmp_path / "ds")
    assert ds.tokenizer_meta["fingerprint"] == tokenizer.fingerprint()
    in_order = texts[12:] + texts[:12]  # the directory's files sorted: docs.jsonl, text/
    for i in (0, 11, 12, 23):
        assert tokenizer.decode(ds.read(*ds.document(i))[:-1]) == in_order[i]


def test_other_inputs_never_replace_a_complete_dataset(corpus, tmp_path, capsys):
    root, _ = corpus
    out = tmp_path / "out"
    first = P.prepare(_request([root / "text"], out))
    inputs = rf"{root / 'text' / '00.txt'}, {root / 'text' / '01.txt'} and 10 more"
    with pytest.raises(DataError, match=rf"--out={out} already holds a dataset prepared from "
                                        rf"other inputs \({inputs}; fingerprint "
                                        rf"{first['fingerprint'][:12]}\): give --overwrite"):
        P.prepare(_request([root / "docs.jsonl"], out))
    with pytest.raises(DataError, match=r"prepared from these inputs with other options or "
                                        r"another tokenizer"):
        P.prepare(_request([root / "text"], out, eos="no"))
    argv = [str(root / "docs.jsonl"), "--out", str(out), "--tokenizer", "bytes", "--no-progress"]
    capsys.readouterr()
    assert command.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxtrain: error: --out=") and len(err) == 1, err
    assert PreparedDataset(out).fingerprint == first["fingerprint"]
    assert not (tmp_path / "out.partial").exists()
    assert P.prepare(_request([root / "text"], out)) == first  # the same command: a no-op
    assert command.main(argv + ["--overwrite"]) == 0
    assert PreparedDataset(out).manifest["sources"][0]["path"] == str(root / "docs.jsonl")


def _repository(tmp_path) -> pathlib.Path:
    """A small git checkout: sources, hidden files and directories, and binary files."""
    repo = tmp_path / "repo"
    (repo / ".git" / "objects").mkdir(parents=True)
    (repo / "src").mkdir()
    (repo / "README.md").write_text("read me\n")
    (repo / "src" / "main.py").write_text("print('hi')\n")
    (repo / ".gitignore").write_text("*.pyc\n")
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "objects" / "ab").write_bytes(b"x\x01blob 10\0hello")
    (repo / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    (repo / "koi8.txt").write_bytes("Привет, мир! ".encode("koi8_r") * 20)  # 69% not UTF-8
    (repo / "latin1.txt").write_bytes("café crème\n".encode("latin-1"))  # 2 bytes of 11
    return repo


def test_directory_inputs_skip_hidden_and_binary_files(tmp_path, capsys):
    repo = _repository(tmp_path)
    manifest = P.prepare(_request([repo], tmp_path / "out"))
    assert [s["path"] for s in manifest["sources"]] == [
        str(repo / "README.md"), str(repo / "latin1.txt"), str(repo / "src" / "main.py")]
    skipped = manifest["report"]["skipped"]
    assert skipped["hidden_files"] == {"count": 3, "first": [f"{repo}/.git/",
                                                             f"{repo}/.gitignore"]}
    assert skipped["binary_files"] == {"count": 2, "first": [str(repo / "koi8.txt"),
                                                             str(repo / "logo.png")]}
    err = capsys.readouterr().err
    assert (f"skipped 3 hidden files (first: {repo}/.git/, {repo}/.gitignore); skipped 2 "
            f"binary files (first: {repo}/koi8.txt, {repo}/logo.png)") in err
    # A file named on its own is taken whatever its name; binary ones are still skipped.
    named = P.layout_inputs(_request([repo / ".gitignore", repo / "logo.png"], tmp_path / "x"))
    assert [i.path for i in named.inputs] == [str(repo / ".gitignore")]
    everything = P.layout_inputs(_request([repo], tmp_path / "x", include_hidden=True,
                                      include_binary=True))
    assert len(everything.inputs) == 8
    assert [count for count, _ in everything.skipped.values()] == [0, 0]
    assert command.main([str(repo), "--out", str(tmp_path / "all"), "--tokenizer", "bytes",
                         "--include-hidden", "--include-binary", "--no-progress"]) == 0
    assert PreparedDataset(tmp_path / "all").num_documents == 8


def test_a_lone_surrogate_is_replaced_and_counted(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "ok one"}\n{"text": "bad \\ud800 here"}\n{"text": "ok two"}\n')
    for name, tokenizer in (("bytes", {}), ("bpe", {"tokenizer": None, "train_tokenizer": 300})):
        manifest = P.prepare(_request([path], tmp_path / name, **tokenizer))
        assert manifest["report"]["invalid_utf8_replaced"] == {"count": 1, "first": [f"{path}:2"]}
        assert not (tmp_path / f"{name}.partial").exists()
    assert _documents(tmp_path / "bytes") == [b"ok one", "bad \ufffd here".encode(), b"ok two"]


def test_a_missing_field_names_the_fields_records_have(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": i, "content": "x"}) + "\n" for i in range(5)))
    with pytest.raises(DataError, match=rf"5 of 5 records were unusable .*; the first record "
                                        rf"without field 'text' \({path}:1\) has fields id, "
                                        rf"content: name the text field with --field NAME"):
        P.prepare(_request([path], tmp_path / "out"))
    manifest = P.prepare(_request([path], tmp_path / "out", field="content"))
    assert manifest["num_documents"] == 5


def test_mostly_replaced_utf8_is_warned_about(tmp_path, capsys):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b"".join(b'{"text": "caf\xe9 %d"}\n' % i for i in range(10)))
    P.prepare(_request([latin], tmp_path / "out"))
    err = capsys.readouterr().err
    assert (f"jaxtrain: warning: 10 of 10 records (100.00%, over 1%) had invalid UTF-8 "
            f"replaced by U+FFFD: is the input in another encoding? first: {latin}:1, "
            f"{latin}:2, {latin}:3") in err
    few = tmp_path / "few.jsonl"  # one record in 200 is noise, not another encoding
    first_line = latin.read_bytes().splitlines(keepends=True)[0]
    few.write_bytes(first_line + b"".join(b'{"text": "ok %d"}\n' % i for i in range(199)))
    P.prepare(_request([few], tmp_path / "few_out"))
    assert "warning" not in capsys.readouterr().err


def _corpus_file(path: pathlib.Path, lines: int, jsonl: bool = False) -> pathlib.Path:
    """About lines * 250 bytes of random words, as text or JSON Lines."""
    rng = np.random.default_rng(len(str(path)))
    words = np.array(["alpha", "beta", "gamma", "delta", "lambda", "naive", "def", "x"])
    rows = [" ".join(rng.choice(words, size=40)) for _ in range(lines)]
    path.write_text("\n".join(json.dumps({"text": r}) if jsonl else r for r in rows) + "\n")
    return path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, None once it is gone."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _descendants(pid: int, workers: int, timeout: float = 60.0) -> dict[int, str]:
    """{pid: command line} of the processes below pid once `workers` spawned workers run
    (the resource tracker runs beside them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parents = {int(p.name): _stat(int(p.name)) for p in pathlib.Path("/proc").iterdir()
                   if p.name.isdigit()}
        below, grew = {pid}, True
        while grew:
            more = {k for k, st in parents.items() if st and st[1] in below} - below
            below, grew = below | more, bool(more)
        below.discard(pid)
        names = {}
        for k in below:
            try:
                names[k] = pathlib.Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
        if sum(b"spawn_main" in name for name in names.values()) >= workers:
            return {k: name.decode(errors="replace") for k, name in names.items()}
        time.sleep(0.1)
    raise AssertionError(f"no {workers} workers under {pid} after {timeout} s")


def _alive(pid: int) -> bool:
    state = _stat(pid)
    return state is not None and state[0] != "Z"  # a zombie has ended (unreaped)


@pytest.mark.slow  # spawns three Python processes and waits for their imports
def test_killed_prepare_takes_its_workers_with_it(tmp_path):
    if not pathlib.Path("/proc/self/stat").exists():
        pytest.skip("finds the workers in /proc")
    P.prepare(_request([_corpus_file(tmp_path / "sample.txt", 200)], tmp_path / "tok",
                       tokenizer=None, train_tokenizer=300, tokenizer_only=True))
    (tmp_path / "in").mkdir()
    for k in range(16):  # 16 MB of BPE work: tens of seconds, killed after the first
        _corpus_file(tmp_path / "in" / f"{k:02d}.jsonl", 4000, jsonl=True)
    parent = subprocess.Popen([sys.executable, "-m", "jaxtrain.commands.prepare",
                               str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                               "--tokenizer", str(tmp_path / "tok"), "--processes", "2",
                               "--no-progress"], stderr=subprocess.PIPE)
    kids = {}
    try:
        kids = _descendants(parent.pid, workers=2)
        assert parent.poll() is None, "prepare finished before it could be killed"
        parent.kill()  # SIGKILL: no clean-up runs in the parent
        parent.wait()
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [name for k, name in kids.items() if _alive(k)]
        assert not left, f"still running after their parent was killed: {left}"
    finally:
        for k in kids:
            if _alive(k):
                os.kill(k, signal.SIGKILL)
        parent.kill()
        parent.wait()
