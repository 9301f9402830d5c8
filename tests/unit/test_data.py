"""Data sources and the grain pipeline: deterministic, addressable by step, clear errors."""

import numpy as np
import pytest
from conftest import small_config

from jaxtrain.data import DataError, make_batches
from jaxtrain.data.sources import stdlib_corpus


def test_batches_are_a_function_of_seed_and_step():
    batches = make_batches(small_config())
    stream = batches.train_iter(0)
    first = [next(stream) for _ in range(5)]
    assert first[0].shape == (16, 33) and first[0].dtype == np.int32
    resumed = batches.train_iter(3)
    np.testing.assert_array_equal(next(resumed), first[3])
    np.testing.assert_array_equal(next(resumed), first[4])
    assert not np.array_equal(first[0], first[1])
    other_seed = make_batches(small_config(seed=1)).train_iter(0)
    assert not np.array_equal(next(other_seed), first[0])


def test_windows_are_next_token_pairs_from_the_corpus():
    corpus = stdlib_corpus()
    assert len(corpus) > 1_000_000
    batch = next(make_batches(small_config()).train_iter(0))
    text = corpus.tobytes()
    for row in batch[:4]:
        assert bytes(row.astype(np.uint8)) in text


def test_validation_split_is_held_out():
    batches = make_batches(small_config(**{"data.val_fraction": 0.05}))
    train_tokens = batches.train_source.tokens
    val_tokens = batches.val_source.tokens
    corpus = stdlib_corpus()
    assert len(train_tokens) + len(val_tokens) == len(corpus)
    np.testing.assert_array_equal(val_tokens, corpus[len(train_tokens):])
    val = batches.val_batches()
    assert len(val) == 4 and all(v.shape == (16, 33) for v in val)


@pytest.mark.parametrize("rows, used, said", [
    (19, 2, "jaxtrain: the validation split holds 19 rows: 2 of the eval_batches=4 batches of "
            "8 rows are used, each row at most once"),
    (40, 4, None),
    (5, 1, "jaxtrain: warning: the validation split holds 5 rows, fewer than one batch of 8: "
           "eval_batches=4 batches of 8 rows are cut to 1, in which some rows count more than "
           "once")])
def test_val_loss_counts_each_row_once(capfd, rows, used, said):
    """A validation split of fewer rows than eval_batches global batches: as many whole
    batches as it holds (the issue's 19-row split with eval_batches 4 logged a val_loss with
    repeated rows), said in one line."""
    from jaxtrain.data.batches import Batches
    val = [np.full(3, i, np.int32) for i in range(rows)]
    batches = Batches(train_source=val, val_source=val, global_batch=8, seed=0, prefetch=1,
                      eval_batches=4)
    got = batches.val_batches()
    assert len(got) == used
    seen = np.concatenate([b[:, 0] for b in got])
    if rows >= 8:
        assert len(set(seen.tolist())) == len(seen) == used * 8  # no row twice
    err = capfd.readouterr().err.strip()
    assert err == (said or "")


def _bin_config(path, **more):
    return small_config(**{"data.source": "bin", "data.path": str(path), **more})


def test_bin_file_source(tmp_path):
    tokens = (np.arange(10_000) % 251).astype(np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    batches = make_batches(_bin_config(tmp_path / "tokens.bin"))
    row = next(batches.train_iter(0))[0]
    start = int(row[0])
    np.testing.assert_array_equal(row, (np.arange(start, start + 33) % 251))


def test_bin_directory_with_splits(tmp_path):
    (np.arange(5000) % 200).astype(np.uint32).tofile(tmp_path / "train.bin")
    np.full(500, 7, np.uint32).tofile(tmp_path / "val.bin")
    batches = make_batches(_bin_config(tmp_path, **{"data.dtype": "uint32"}))
    assert (batches.val_batches()[0] == 7).all()
    assert next(batches.train_iter(0)).max() < 200


@pytest.mark.parametrize("setup,message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_bytes(b""), "is empty"),
    (lambda p: p.write_bytes(b"abc"), "not a whole number of uint16 tokens"),
    (lambda p: np.full(1000, 300, np.uint16).tofile(p), "holds token id 300, outside model.vocab_size=256"),
    (lambda p: np.ones(20, np.uint16).tofile(p), "fewer than one sequence"),
])
def test_bad_bin_files_are_clear_errors(tmp_path, setup, message):
    path = tmp_path / "tokens.bin"
    setup(path)
    with pytest.raises(DataError, match=message):
        make_batches(_bin_config(path))


def test_synthetic_source_is_deterministic():
    cfg = small_config(**{"data.source": "synthetic", "model.vocab_size": 1000})
    a = next(make_batches(cfg).train_iter(2))
    b = next(make_batches(cfg).train_iter(2))
    np.testing.assert_array_equal(a, b)
    assert a.max() < 1000 and a.max() > 256
