"""data.source='prepared': training on datasets made by `jaxtrain prepare`, alone or mixed.

- `data.path=DIR`: one dataset. Validation is `data.val_path` (another prepared dataset) or
  the tail of DIR's documents holding about `data.val_fraction` of its tokens (cut at a
  document boundary, so no document is in both).
- `data.mixture="DIR:WEIGHT,DIR:WEIGHT,..."`: several datasets drawn by weight. Each is
  repeated and shuffled with its own seed, and grain interleaves them in a fixed pattern of
  their (integer-scaled) weights, so row r of the stream is a pure function of (seed, r):
  any step's batch, on any process, is read without reading the ones before, and a resumed
  run reads exactly what the uninterrupted run would have. Validation mixes the components'
  held-out tails by the same weights, or is `data.val_path`.

Any of the paths may be a gs:// or s3:// prefix (read through jaxtrain.data.remote_file).
Every dataset must have been prepared with the same tokenizer, whose vocabulary must fit
model.vocab_size. `check`, `splits`, `fingerprint` and `tokenizer` make its entry in the
data-source registry (jaxtrain.data.sources).
"""

from __future__ import annotations

import grain
import numpy as np

from jaxtrain.data import fingerprints, remote_file, tokenizers
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.data.packing import PackedDocuments
from jaxtrain.data.pairs import PairRows, split_pairs
from jaxtrain.errors import ConfigError, DataError

NAME = "prepared"


def parse_mixture(text: str) -> list[tuple[str, float]]:
    """'DIR:W,DIR:W' -> [(DIR, W), ...]; ConfigError naming data.mixture when malformed."""
    parts = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        path, sep, weight = item.rpartition(":")
        try:
            value = float(weight) if sep else float("nan")
        except ValueError:
            value = float("nan")
        if not path or not value > 0:
            raise ConfigError(f"data.mixture={text!r} is invalid: a comma-separated list of "
                              "PATH:WEIGHT with weights > 0, e.g. 'data/web:0.7,data/code:0.3'")
        parts.append((path, value))
    return parts


def check(c) -> None:
    """Config checks, before anything is read or compiled."""
    d = c.data
    if bool(d.path) == bool(d.mixture):
        raise ConfigError(f"data.path={d.path!r} and data.mixture={d.mixture!r}: "
                          "data.source='prepared' needs exactly one of them (a prepared "
                          "dataset directory, or PATH:WEIGHT,...)")
    if d.mixture:
        parse_mixture(d.mixture)
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction!r} is invalid: must be between "
                          "0 and 1")


def _open(c, path, what: str) -> PreparedDataset:
    """A dataset of the config; on object storage read through the process's block cache as
    data.cache_mb and data.block_kb size it."""
    return PreparedDataset(path, what, remote_file.cache_for(c))


def _components(c) -> list[tuple[PreparedDataset, float, str]]:
    if c.data.mixture:
        return [(_open(c, path, f"data.mixture entry {path}"), weight,
                 f"data.mixture entry {path}")
                for path, weight in parse_mixture(c.data.mixture)]
    return [(_open(c, c.data.path, "data.path"), 1.0, "data.path")]


def open_all(c) -> tuple[list[tuple[PreparedDataset, float, str]], PreparedDataset | None]:
    """The datasets of the config, checked to share one tokenizer that fits the model."""
    components = _components(c)
    val = _open(c, c.data.val_path, "data.val_path") if c.data.val_path else None
    everyone = [(ds, what) for ds, _, what in components] + ([(val, "data.val_path")]
                                                             if val else [])
    first, first_what = everyone[0]
    for ds, what in everyone[1:]:
        if ds.tokenizer_meta["fingerprint"] != first.tokenizer_meta["fingerprint"]:
            raise DataError(f"{what}={ds.path} was prepared with tokenizer "
                            f"{_about(ds.tokenizer_meta)}, {first_what}={first.path} with "
                            f"{_about(first.tokenizer_meta)}; prepare them with one tokenizer")
    vocab = first.tokenizer_meta["vocab_size"]
    if vocab > c.model.vocab_size:
        raise DataError(f"{first_what}={first.path}: its tokenizer has {vocab} ids, more than "
                        f"model.vocab_size={c.model.vocab_size}; set model.vocab_size >= {vocab}")
    return components, val


def _about(meta: dict) -> str:
    return f"{meta['kind']} ({meta['vocab_size']} ids, sha256 {meta['fingerprint'][:12]})"


class PreparedWindows:
    """Non-overlapping windows of seq_len + 1 tokens over tokens [start, end) of a dataset
    (documents concatenated: data.packing='concat')."""

    def __init__(self, dataset: PreparedDataset, start: int, end: int, seq_len: int,
                 name: str):
        if end - start < seq_len + 1:
            raise DataError(f"{name} holds {end - start} tokens, fewer than one sequence of "
                            f"model.seq_len+1={seq_len + 1}")
        self.dataset, self.start, self.seq_len = dataset, start, seq_len
        self.size = (end - start - 1) // seq_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        offset = self.start + (index % self.size) * self.seq_len
        return self.dataset.read(offset, self.seq_len + 1)


def _rows(c, ds: PreparedDataset, start: int, end: int, name: str, masked: bool = False):
    """The rows of tokens [start, end) of ds as data.packing says: windows of the
    concatenated documents, or documents packed into rows (jaxtrain.data.packing), with a
    loss mask when the run's data has one (`masked`)."""
    if c.data.packing == "documents":
        return PackedDocuments(ds, start, end, c.model.seq_len, name, masked=masked)
    return PreparedWindows(ds, start, end, c.model.seq_len, name)


def _split_windows(ds: PreparedDataset, c, what: str, masked: bool) -> tuple[object, object]:
    fraction = c.data.val_fraction
    if ds.num_documents >= 2:
        cut = ds.document(ds.split_point(fraction))[0]
    else:
        cut = int(ds.num_tokens * (1.0 - fraction))
    return (_rows(c, ds, 0, cut, f"the training split of {what}={ds.path}", masked),
            _rows(c, ds, cut, ds.num_tokens, f"the validation split of {what}={ds.path}",
                  masked))


def _masked(c, datasets: list[tuple[PreparedDataset, str]]) -> bool:
    """Whether the run's rows carry a loss mask: when any dataset has one (chat data), and
    then every row does (a mixture's unmasked datasets count every target). A mask needs
    documents packed into rows: windows of the concatenated stream would cut conversations
    anywhere, so concat refuses it."""
    masked = [(ds, what) for ds, what in datasets if ds.masked]
    if masked and c.data.packing != "documents":
        ds, what = masked[0]
        raise ConfigError(f"data.packing={c.data.packing!r} cannot keep the loss mask of "
                          f"{what}={ds.path} (a chat dataset): set data.packing='documents'")
    return bool(masked)


class MixtureWindows:
    """Windows of several sources drawn by weight; `grain_dataset(seed)` is the infinite,
    shuffled training stream, and plain indexing the unshuffled mixture (validation)."""

    def __init__(self, sources: list, weights: list[float]):
        self.sources, self.weights = sources, weights
        self._plain = self.grain_dataset(None)

    def grain_dataset(self, seed: int | None) -> grain.MapDataset:
        parts = []
        for k, source in enumerate(self.sources):
            ds = grain.MapDataset.source(source).repeat(None)
            parts.append(ds if seed is None else ds.shuffle(seed=seed + k))
        return grain.MapDataset.mix(parts, self.weights)

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def __getitem__(self, index: int) -> np.ndarray:
        return self._plain[index]


def _check_pairs(c, datasets: list[tuple[PreparedDataset, str]]) -> None:
    """Preference pairs are read as pairs (data.packing='pairs'), and only they are."""
    pairs = c.data.packing == "pairs"
    for ds, what in datasets:
        if ds.pairs and not pairs:
            raise ConfigError(f"{what}={ds.path} holds preference pairs (prepare "
                              "--preference): set data.packing='pairs' and "
                              "train.objective='dpo'")
        if pairs and not ds.pairs:
            raise ConfigError(f"data.packing='pairs' needs a dataset of preference pairs, "
                              f"and {what}={ds.path} is not one: prepare it with --preference")


def _pair_splits(c, ds: PreparedDataset, val_ds: PreparedDataset | None):
    """(train, validation) rows of pairs: validation is data.val_path, or the tail of
    about data.val_fraction of the pairs."""
    pairs, seq = ds.num_documents // 2, c.model.seq_len
    if val_ds is not None:
        return (PairRows(ds, 0, pairs, seq, f"data.path={ds.path}"),
                PairRows(val_ds, 0, val_ds.num_documents // 2, seq,
                         f"data.val_path={val_ds.path}"))
    if pairs < 2:
        raise DataError(f"data.path={ds.path} holds {pairs} preference pair(s): at least 2 "
                        "are needed (one to train on, one held out), or give data.val_path")
    cut = split_pairs(pairs, c.data.val_fraction)
    return (PairRows(ds, 0, cut, seq, f"the training split of data.path={ds.path}"),
            PairRows(ds, cut, pairs, seq, f"the validation split of data.path={ds.path}"))


def splits(c) -> tuple[object, object]:
    """(train, validation) random-access rows for data.source='prepared'."""
    check(c)
    components, val_ds = open_all(c)
    _check_pairs(c, [(ds, what) for ds, _, what in components]
                 + ([(val_ds, "data.val_path")] if val_ds is not None else []))
    if c.data.packing == "pairs":  # one dataset (the dpo objective refuses mixtures)
        return _pair_splits(c, components[0][0], val_ds)
    masked = _masked(c, [(ds, what) for ds, _, what in components]
                     + ([(val_ds, "data.val_path")] if val_ds is not None else []))
    trains, vals = [], []
    for ds, _, what in components:
        if val_ds is None:
            train, val = _split_windows(ds, c, what, masked)
            vals.append(val)
        else:
            train = _rows(c, ds, 0, ds.num_tokens, f"{what}={ds.path}", masked)
        trains.append(train)
    if val_ds is not None:
        vals = [_rows(c, val_ds, 0, val_ds.num_tokens, f"data.val_path={val_ds.path}",
                      masked)]
    if len(trains) == 1:
        return trains[0], vals[0]
    weights = [w for _, w, _ in components]
    return MixtureWindows(trains, weights), (vals[0] if len(vals) == 1
                                             else MixtureWindows(vals, weights))


def fingerprint(c) -> dict[str, dict]:
    """What the run trains and validates on: {item: {fingerprint, about}}."""
    components, val = open_all(c)
    items = {}
    for ds, _, what in components:
        items[what] = fingerprints.item(
            ds.fingerprint, f"{ds.path} ({ds.num_documents:,} documents, {ds.num_tokens:,} "
                            f"tokens, sha256 {ds.fingerprint[:12]})")
    if c.data.mixture:
        weights = ",".join(f"{w:g}" for _, w, _ in components)
        items["data.mixture weights"] = fingerprints.item(weights, weights)
    if val is not None:
        items["data.val_path"] = fingerprints.item(
            val.fingerprint, f"{val.path} (sha256 {val.fingerprint[:12]})")
    else:
        items["data.val_fraction"] = fingerprints.value(c.data.val_fraction)
    return items


def tokenizer(c) -> tokenizers.Tokenizer:
    """The tokenizer the datasets were prepared with (open_all checks they share one)."""
    ds, _, what = _components(c)[0]
    # Checked against the manifest: a tokenizer/ overwritten since would misread the ids.
    return tokenizers.load_recorded(ds.tokenizer_dir, ds.tokenizer_meta, what)
