"""Training on prepared datasets: windows, held-out split, mixtures, and what a run records."""

import json
import re

import jax
import numpy as np
import pytest
from conftest import small_config

from jaxtrain.data import fingerprints, prepared_source, record
from jaxtrain.data.batches import make_batches
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.prepare import pipeline as P


def _prepare(tmp_path, name: str, texts: list[str], **more) -> str:
    root = tmp_path / f"{name}_in"
    root.mkdir()
    for i, text in enumerate(texts):
        (root / f"{i:04d}.txt").write_text(text)
    out = tmp_path / name
    P.prepare(P.Request.build(inputs=[str(root)], out=str(out), progress=False, processes=1,
                              **{"tokenizer": "bytes", **more}))
    return str(out)


def _letters(letters: str, n: int = 60, seed: int = 0) -> list[str]:
    """n documents of random letters drawn from `letters` (so that a row tells its source)."""
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(letters), int(rng.integers(20, 200)))) for _ in range(n)]


LOWER, UPPER = "abcdefghij", "ABCDEFGHIJ"


def _within(rows: np.ndarray, letters: str) -> np.ndarray:
    return np.isin(rows, [ord(c) for c in letters]).all(axis=1)


def _cfg(**overrides):
    return small_config(**{"data.source": "prepared", **overrides})


def test_windows_come_from_the_dataset_and_validation_holds_whole_documents(tmp_path):
    texts = [f"document {i}: " + "abc " * (i % 17 + 3) for i in range(200)]
    path = _prepare(tmp_path, "ds", texts)
    batches = make_batches(_cfg(**{"data.path": path, "data.val_fraction": 0.1}))
    ds = PreparedDataset(path)
    everything = ds.read(0, ds.num_tokens)
    train, val = batches.train_source, batches.val_source
    starts = {ds.document(i)[0] for i in range(ds.num_documents)}
    assert val.start in starts  # cut at a document boundary
    assert abs(val.start / ds.num_tokens - 0.9) < 0.02
    assert train.start == 0 and train.size == (val.start - 1) // 32
    text = everything.astype(np.uint8).tobytes()
    first = [next(batches.train_iter(0)) for _ in range(1)][0]
    for row in first:
        position = text.find(row.astype(np.uint8).tobytes())
        assert 0 <= position and position + 33 <= val.start
    stream = batches.train_iter(0)
    seen = [next(stream) for _ in range(5)]
    np.testing.assert_array_equal(next(batches.train_iter(3)), seen[3])
    for batch in batches.val_batches():
        for row in batch:
            assert text.find(row.astype(np.uint8).tobytes(), val.start) >= val.start


def test_a_separate_validation_dataset(tmp_path):
    train = _prepare(tmp_path, "train", _letters(LOWER))
    val = _prepare(tmp_path, "val", _letters(UPPER))
    batches = make_batches(_cfg(**{"data.path": train, "data.val_path": val}))
    assert _within(batches.val_batches()[0], UPPER).all()
    assert _within(next(batches.train_iter(0)), LOWER).all()


def _mixture(tmp_path):
    a = _prepare(tmp_path, "a", _letters(LOWER))
    b = _prepare(tmp_path, "b", _letters(UPPER, seed=1))
    return _cfg(**{"data.mixture": f"{a}:3,{b}:1"})


def test_mixture_is_a_function_of_seed_and_step_and_follows_the_weights(tmp_path):
    cfg = _mixture(tmp_path)
    stream = make_batches(cfg).train_iter(0)
    batches = [next(stream) for _ in range(12)]
    resumed = make_batches(cfg).train_iter(7)  # a resumed run reads the same batches
    for step in range(7, 12):
        np.testing.assert_array_equal(next(resumed), batches[step])
    rows = np.concatenate(batches)
    from_a = _within(rows, LOWER)
    assert from_a.sum() + _within(rows, UPPER).sum() == len(rows)
    assert from_a.mean() == pytest.approx(0.75, abs=0.01)
    other_seed = next(make_batches(_mixture_seed(cfg, 1)).train_iter(0))
    assert not np.array_equal(other_seed, batches[0])
    val = make_batches(cfg).val_batches()[0]
    assert _within(val, LOWER).mean() == pytest.approx(0.75, abs=0.1)


def _mixture_seed(cfg, seed):
    cfg = cfg.copy_and_resolve_references()
    cfg.seed = seed
    return cfg


def test_each_process_reads_only_its_slice_of_a_mixture(tmp_path, monkeypatch):
    cfg = _mixture(tmp_path)
    cfg.data.prefetch = 0  # no read-ahead: count exactly what one step reads
    whole = [next(make_batches(cfg).train_iter(5))]
    reads = []
    original = prepared_source.PreparedWindows.__getitem__
    monkeypatch.setattr(prepared_source.PreparedWindows, "__getitem__",
                        lambda self, i: reads.append(i) or original(self, i))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    parts = []
    for index in range(2):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        reads.clear()
        iterator = make_batches(cfg).train_iter(5)
        parts.append(next(iterator))
        del iterator
        assert len(reads) == 8  # its half of the global batch of 16, nothing more
    np.testing.assert_array_equal(np.concatenate(parts), whole[0])


def test_prepared_config_and_data_errors(tmp_path):
    a = _prepare(tmp_path, "a", _letters(LOWER))
    bpe = _prepare(tmp_path, "bpe", _letters(LOWER) + ["hello world"] * 20, tokenizer=None,
                   train_tokenizer=300)
    vocab = PreparedDataset(bpe).tokenizer_meta["vocab_size"]
    cases = [
        ({"data.path": a, "data.mixture": f"{a}:1"}, ConfigError, "needs exactly one of them"),
        ({"data.mixture": f"{a}:0"}, ConfigError, "PATH:WEIGHT with weights > 0"),
        ({"data.mixture": f"{a}:1,{bpe}:1", "model.vocab_size": 512}, DataError,
         f"data.mixture entry {bpe}={bpe} was prepared with tokenizer huggingface ({vocab} ids"),
        ({"data.path": bpe}, DataError,
         f"its tokenizer has {vocab} ids, more than model.vocab_size=256"),
        ({"data.path": str(tmp_path / "nothing")}, DataError, "is not a prepared dataset"),
    ]
    for overrides, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            make_batches(_cfg(**overrides))


def test_a_resume_on_other_data_is_refused_naming_it(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    workdir.mkdir()
    cfg = small_config()
    items, tokenizer = record.run_data(cfg)
    record.check_and_store(workdir, items, tokenizer, resumed=False, allow_changed=False,
                           write=True)
    saved = json.loads((workdir / "data.json").read_text())
    assert "Python 3." in saved["items"]["the stdlib corpus"]["about"]
    assert record.run_tokenizer(workdir, cfg).kind == "bytes"
    # The same data: resumes.
    record.check_and_store(workdir, *record.run_data(cfg), True, False, True)
    # Another Python's standard library: refused in one line naming both.
    monkeypatch.setattr(fingerprints, "stdlib_corpus", lambda files: {
        "fingerprint": "0" * 64, "about": "the stdlib corpus of Python 3.99.0 (...)"})
    with pytest.raises(DataError, match=r"the data changed since this run started: the stdlib "
                       r"corpus was the stdlib corpus of Python 3\.\d+\.\d+ .*, now the stdlib "
                       r"corpus of Python 3\.99\.0 .*; set data\.allow_changed=True") as e:
        record.check_and_store(workdir, *record.run_data(cfg), True, False, True)
    assert "\n" not in str(e.value)
    record.check_and_store(workdir, *record.run_data(cfg), True, True, True)
    history = json.loads((workdir / "data.json").read_text())["history"]
    assert len(history) == 1 and "Python 3.99.0" in history[0]["changes"][0]
    # A fresh start in the same directory just records the new data.
    record.check_and_store(workdir, *record.run_data(cfg), False, False, True)


def test_a_run_refuses_data_of_another_tokenizer(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    path = _prepare(tmp_path, "bpe", _letters(LOWER) + ["hello world"] * 20, tokenizer=None,
                    train_tokenizer=300)
    bytes_cfg = small_config()
    record.check_and_store(workdir, *record.run_data(bytes_cfg), False, False, True)
    cfg = _cfg(**{"data.path": path, "model.vocab_size": 512})
    with pytest.raises(DataError, match=r"the data was made with tokenizer huggingface "
                       r"tokenizer \(\d+ ids, sha256 [0-9a-f]{12}\), but this run started with "
                       r"bytes \(UTF-8, 256 ids\)"):
        record.check_and_store(workdir, *record.run_data(cfg), True, True, True)


@pytest.mark.slow
def test_training_on_a_prepared_dataset_records_it_and_refuses_a_changed_one(tmp_path,
                                                                              devices):
    from jaxtrain.train.loop import run

    path = _prepare(tmp_path, "ds", [f"line {i} " * 30 for i in range(80)])
    cfg = _cfg(**{"data.path": path, "steps": 2, "eval_every_steps": 2})
    workdir = tmp_path / "run"
    rows = run(cfg, workdir, devices[:1])
    assert rows[-1]["step"] == 2
    data = json.loads((workdir / "data.json").read_text())
    assert data["items"]["data.path"]["fingerprint"] == PreparedDataset(path).fingerprint
    assert (workdir / "tokenizer" / "jaxtrain_tokenizer.json").is_file()
    _prepare(tmp_path, "other", [f"other {i} " * 30 for i in range(80)])
    cfg.data.path, cfg.steps = str(tmp_path / "other"), 4
    with pytest.raises(DataError, match=rf"the data changed since this run started: data.path "
                                        rf"was {re.escape(path)} \("):
        run(cfg, workdir, devices[:1])
    assert not (workdir / "checkpoints" / "4").exists()


def test_a_mixture_member_whose_prepare_failed_says_what_failed(tmp_path):
    good = _prepare(tmp_path, "good", _letters(LOWER))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n" * 5 + '{"text": "fine"}\n' * 5)
    bad = tmp_path / "bad"

    def prepare(limit):
        return P.prepare(P.Request.build(inputs=[str(broken)], out=str(bad), tokenizer="bytes",
                                         progress=False, processes=1, max_bad_fraction=limit))

    with pytest.raises(DataError, match="5 of 10 records were unusable"):
        prepare(0.01)
    with pytest.raises(DataError, match=rf"data.mixture entry {bad}={bad} is not a prepared "
                                        rf"dataset \(no manifest.json\); its prepare failed "
                                        rf"\({bad}.partial\): 5 of 10 records were unusable "
                                        rf".*; fix that, then prepare it again") as e:
        make_batches(_cfg(**{"data.mixture": f"{good}:1,{bad}:1"}))
    assert "run the same prepare command" not in str(e.value) and "\n" not in str(e.value)
    # Fixed (here: a higher limit, the same plan): the rerun resumes and the record goes.
    assert prepare(0.6)["num_documents"] == 5
    assert not (bad / "failed.json").exists() and PreparedDataset(bad).num_documents == 5
