"""data.packing='documents' (data/packing.py): rows train every prediction of every document
exactly once; a packed row gives each document the per-token losses it has when run alone;
the packed step trains the same numbers on pipeline, sequence-parallel and accumulating
meshes as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import small_config
from flax import nnx
from helpers import assert_params_close, train_steps

from jaxtrain.config import validate
from jaxtrain.data.batches import make_batches
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.data.packing import Packed, PackedDocuments
from jaxtrain.errors import ConfigError
from jaxtrain.prepare import pipeline as P
from jaxtrain.train.setup import build
from jaxtrain.train.step import counted_targets, loss_fn


class FakeDataset:
    """Documents of the given lengths, back to back; token i of the dataset is i."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths

    def documents_in(self, lo, hi):
        keep = (self.starts < hi) & (self.starts + self.lengths > lo)
        return self.starts[keep], self.lengths[keep]

    def read(self, start, length):
        return np.arange(start, start + length, dtype=np.int32)


def test_rows_train_every_prediction_once():
    rng = np.random.default_rng(0)
    lengths = [1, 40, 2, 17, 3, 1, 120, *rng.integers(1, 30, 200)]
    ds, seq = FakeDataset(lengths), 16
    rows = PackedDocuments(ds, 0, int(sum(lengths)), seq, "fake")
    pairs = []
    for i in range(len(rows)):
        row = rows[i]
        assert row.tokens.shape == (seq + 1,)
        ids = row.segments
        used = int((ids != 0).sum())
        assert (ids[:used] != 0).all() and (ids[used:] == 0).all()  # padding at the end
        assert (np.diff(ids[:used]) >= 0).all()  # each document one run, in order
        for k in np.unique(ids[:used]):
            run = np.flatnonzero(ids == k)
            np.testing.assert_array_equal(row.positions[run], np.arange(len(run)))
        counted = np.asarray(counted_targets(jnp.asarray(ids[None])))[0]
        pairs += [(int(row.tokens[j]), int(row.tokens[j + 1]))
                  for j in np.flatnonzero(counted)]
    want = [(int(s + j), int(s + j + 1)) for s, n in zip(ds.starts, ds.lengths)
            for j in range(n - 1)]
    assert sorted(pairs) == want  # each prediction once, none across documents


@pytest.mark.parametrize("windows", [1, 3])
def test_no_row_is_only_padding(windows):
    """The last window's rows are only those that hold documents: 30 conversations of about
    280 tokens at seq 640 (issue #35: 13 of 64 rows held any) fill 15 rows, not 64; and the
    rows are a function of the index alone, the same from a fresh packer."""
    rng = np.random.default_rng(3)
    seq = 640 if windows == 1 else 64
    total = 8500 if windows == 1 else int(2.5 * (64 * 63 - 65) * 64 // 65)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(60, 500 if windows == 1 else 100)))
    ds = FakeDataset(lengths)
    rows = PackedDocuments(ds, 0, int(sum(lengths)), seq, "fake")
    assert rows.windows == windows and len(rows) < windows * 64
    used = [int((rows[i].segments != 0).sum()) for i in range(len(rows))]
    tail = used[(windows - 1) * 64:]
    assert len(tail) < 64 and min(tail) > 0  # the last window: no row of padding alone
    # a full window holds window_tokens(L) tokens, which fill all but R - ceil(S/(L+1)) of
    # its rows (3 here; 1 at L >= 200): dropping those too would plan every window of the
    # dataset at start-up
    assert used.count(0) <= 3 * (windows - 1)
    real = sum(used) / (len(rows) * (seq + 1))
    assert real > 0.9, real
    if windows == 1:
        assert len(rows) <= -(-sum(lengths) // (seq + 1)) + 1  # best fit: one over at most
    again = PackedDocuments(ds, 0, int(sum(lengths)), seq, "fake")
    for i in rng.integers(0, 3 * len(rows), 20):  # indices wrap around, as the stream's
        np.testing.assert_array_equal(again[int(i)].tokens, rows[int(i)].tokens)
        np.testing.assert_array_equal(again[int(i)].segments, rows[int(i)].segments)


@pytest.mark.parametrize("family,kernel", [("gpt2", "xla"), ("llama", "chunked")])
def test_packed_losses_equal_documents_alone(family, kernel, devices):
    """gpt2: learned positions; llama: RoPE and grouped-query heads. A document alone is a
    row of its own, zeros after it (causal: they change none of its losses)."""
    cfg = small_config(family, **{"model.attention": kernel, "data.packing": "documents",
                                  "data.source": "synthetic", "model.num_layers": 1})
    setup = build(cfg, devices[:1])
    params = setup.init_state().params
    lengths = [7, 12, 2, 9]  # 30 of 33 slots, then padding
    rng = np.random.default_rng(1)
    packed = np.zeros((3, 1, 33), np.int32)  # tokens, segments, positions of one row
    alone = np.zeros((len(lengths), 33), np.int32)  # each document in a row of its own
    at = 0
    for k, n in enumerate(lengths, start=1):
        doc = rng.integers(0, cfg.model.vocab_size, n)
        packed[0, 0, at:at + n], packed[1, 0, at:at + n] = doc, k
        packed[2, 0, at:at + n] = np.arange(n)
        alone[k - 1, :n] = doc
        at += n

    @jax.jit
    def token_losses(params, tokens_BT, segments_BT, positions_BT):
        model = nnx.merge(setup.graphdef, params)
        logits_BLV = model(tokens_BT[:, :-1], segments_BT[:, :-1], positions_BT[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits_BLV.astype(jnp.float32), tokens_BT[:, 1:])

    with jax.set_mesh(setup.mesh):
        # One batch: the packed row, and each document alone (one segment, positions 0..).
        tokens = np.concatenate([packed[0], alone])
        ids = np.concatenate([packed[1], np.ones_like(alone)])
        pos = np.concatenate([packed[2], np.broadcast_to(np.arange(33), alone.shape)])
        losses = np.asarray(token_losses(params, tokens, ids, pos))
        mean = float(jax.jit(loss_fn, static_argnums=1)(
            params, setup.graphdef, Packed(*map(jnp.asarray, packed))))
    counted = np.asarray(counted_targets(jnp.asarray(packed[1])))[0]
    want = np.concatenate([losses[k, :n - 1] for k, n in enumerate(lengths, start=1)])
    np.testing.assert_allclose(losses[0, counted], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean, want.mean(), rtol=1e-5)


_reference = {}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    {"mesh.pipeline": 2, "mesh.data": 4, "pipeline.microbatches": 2},
    {"mesh.tensor": 2, "mesh.fsdp": 2, "mesh.data": 2, "mesh.sequence_parallel": True,
     "train.microbatches": 2},
])
def test_packed_training_matches_one_device(mesh, devices):
    """The ids and positions travel with their rows through the pipeline's stages, the
    sequence-sharded activations and the accumulated micro-batches (each weighted by its
    counted targets)."""
    def config(**overrides):
        return small_config("llama", **{"data.packing": "documents", "data.source": "synthetic",
                                        "model.attention": "chunked",
                                        **overrides})

    if not _reference:
        _reference["run"] = train_steps(config(), devices[:1], steps=2)
    ref_losses, ref_params, _ = _reference["run"]
    losses, params, _ = train_steps(config(**mesh), devices, steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert_params_close(params, ref_params, rtol=1e-5)


def _prepared(tmp_path) -> str:
    """60 documents of 5–150 letters (bytes tokenizer: token = byte), as prepare writes them."""
    rng = np.random.default_rng(2)
    (tmp_path / "in").mkdir()
    for i in range(60):
        text = "".join(rng.choice(list("abcdefghij"), int(rng.integers(5, 150))))
        (tmp_path / "in" / f"{i:03d}.txt").write_text(text)
    P.prepare(P.Request.build(inputs=[str(tmp_path / "in")], out=str(tmp_path / "ds"),
                              progress=False, processes=1, tokenizer="bytes"))
    return str(tmp_path / "ds")


def test_prepared_rows_hold_its_documents(tmp_path):
    """Through the real document index (PreparedDataset.documents_in) and the train split:
    every packed piece lies inside one document, and the split's predictions all train."""
    path = _prepared(tmp_path)
    cfg = small_config(**{"data.source": "prepared", "data.path": path,
                          "data.packing": "documents", "data.val_fraction": 0.2})
    train = make_batches(cfg).train_source
    ds = PreparedDataset(path)
    docs = [ds.read(*ds.document(i)).tobytes() for i in range(ds.num_documents)]
    in_train = [d for i, d in enumerate(docs) if ds.document(i)[0] < train.end]
    counted = 0
    for i in range(len(train)):
        row = train[i]
        for k in set(row.segments[row.segments != 0].tolist()):
            piece = row.tokens[row.segments == k].tobytes()
            assert any(piece in d for d in in_train)
            counted += int((row.segments == k).sum()) - 1
    assert counted == sum(len(d) // 4 - 1 for d in in_train)  # int32 bytes: 4 per token


@pytest.mark.slow
def test_a_run_trains_and_evaluates_packed_documents(tmp_path, devices):
    """The loop on packed rows, then `jaxtrain eval`'s pieces on its validation rows: the
    same loss as the loop's eval, and bits per byte from the counted targets' bytes."""
    from jaxtrain import inference
    from jaxtrain.commands.eval import target_bytes
    from jaxtrain.data import record
    from jaxtrain.train.loop import run

    cfg = small_config(**{"data.source": "prepared", "data.path": _prepared(tmp_path),
                          "data.packing": "documents", "steps": 2, "eval_every_steps": 2,
                          "eval_batches": 1, "data.val_fraction": 0.3})
    workdir = tmp_path / "run"
    rows = run(cfg, workdir, devices[:1])
    assert np.isfinite(rows[-1]["loss"])
    # tokens/s counts trained tokens: fewer than the batch's slots (padding left out)
    per_step = cfg.train.global_batch * cfg.model.seq_len
    assert 0 < rows[-1]["tokens_per_s"] * rows[-1]["step_time_s"] < per_step
    _, run_cfg = inference.run_config(workdir)
    _, windows, _ = inference.evaluation_windows(run_cfg, None)
    loaded = inference.load(workdir, batch=cfg.train.global_batch)
    result = inference.evaluate(loaded, windows, 1)
    np.testing.assert_allclose(result["loss"], rows[-1]["val_loss"], rtol=1e-5)
    tokenizer = record.run_tokenizer(workdir, run_cfg)  # bytes: one byte per token
    assert target_bytes(tokenizer, windows, cfg.train.global_batch) == result["tokens"]
    # The validation rows are packed documents too. Their first rows are pieces of the
    # longest documents (best fit takes the longest first), each filling its row, so the
    # first batch counts every target; over all the rows, padding and the targets across a
    # document boundary are left out.
    assert isinstance(windows[0], Packed)
    # every row once (no row is padding alone; the last batch wraps to the first rows)
    batches = -(-len(windows) // cfg.train.global_batch)
    everything = inference.evaluate(loaded, windows, batches)
    assert everything["tokens"] == sum(int(counted_targets(windows[i].segments).sum())
                                       for i in range(batches * cfg.train.global_batch))
    assert everything["tokens"] < batches * per_step


def test_sources_without_documents_refuse_packing():
    cfg = small_config("gpt2", **{"data.packing": "documents", "data.source": "stdlib"})
    with pytest.raises(ConfigError, match="data.packing"):
        validate(cfg, 1)
