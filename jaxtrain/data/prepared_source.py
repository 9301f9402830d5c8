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

from jaxtrain.data import fingerprints, layouts, remote_file, tokenizers
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.data.windows import PreparedWindows  # noqa: F401 (its old home)
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


def _splits_of(c, layout, ds: PreparedDataset, what: str, masked: bool):
    """(train, validation) rows of one dataset: its held-out tail of about
    data.val_fraction is the validation split (layout.held_out: at a unit boundary)."""
    cut, seq = layout.held_out(ds, c.data.val_fraction, what), c.model.seq_len
    return (layout.rows(ds, 0, cut, seq, f"the training split of {what}={ds.path}", masked),
            layout.rows(ds, cut, layout.units(ds), seq,
                        f"the validation split of {what}={ds.path}", masked))


def _whole(c, layout, ds: PreparedDataset, what: str, masked: bool):
    """Rows of all of a dataset's units."""
    return layout.rows(ds, 0, layout.units(ds), c.model.seq_len, f"{what}={ds.path}", masked)


def _masked(c, layout, datasets: list[tuple[PreparedDataset, str]]) -> bool:
    """Whether the run's rows carry a loss mask: when any dataset has one (chat data), and
    then every row does (a mixture's unmasked datasets count every target). A mask needs a
    layout that keeps it (documents packed into rows: windows of the concatenated stream
    would cut conversations anywhere)."""
    masked = [(ds, what) for ds, what in datasets if ds.masked]
    if masked and not layout.loss_mask:
        ds, what = masked[0]
        keeps = layouts.named(lambda other: other.loss_mask and other.pairs == ds.pairs)
        raise ConfigError(f"data.packing={c.data.packing!r} cannot keep the loss mask of "
                          f"{what}={ds.path} (a chat dataset): set {keeps}")
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


def _check_pairs(c, layout, datasets: list[tuple[PreparedDataset, str]]) -> None:
    """Preference pairs are read by a layout of pairs, and only they are."""
    for ds, what in datasets:
        if ds.pairs and not layout.pairs:
            first = next(n for n, other in layouts.LAYOUTS.items() if other.pairs)
            raise ConfigError(f"{what}={ds.path} holds preference pairs (prepare "
                              f"--preference): set data.packing={first!r} and a "
                              "train.objective that trains on pairs (docs/finetune.md)")
        if layout.pairs and not ds.pairs:
            raise ConfigError(f"data.packing={c.data.packing!r} needs a dataset of preference "
                              f"pairs, and {what}={ds.path} is not one: prepare it with "
                              "--preference")


def splits(c) -> tuple[object, object]:
    """(train, validation) random-access rows for data.source='prepared', in the layout
    data.packing names (data/layouts.py)."""
    check(c)
    layout = layouts.LAYOUTS[c.data.packing]
    components, val_ds = open_all(c)
    everyone = [(ds, what) for ds, _, what in components] + (
        [(val_ds, "data.val_path")] if val_ds is not None else [])
    _check_pairs(c, layout, everyone)
    masked = _masked(c, layout, everyone)
    trains, vals = [], []
    for ds, _, what in components:
        if val_ds is None:
            train, val = _splits_of(c, layout, ds, what, masked)
            vals.append(val)
        else:
            train = _whole(c, layout, ds, what, masked)
        trains.append(train)
    if val_ds is not None:
        vals = [_whole(c, layout, val_ds, "data.val_path", masked)]
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
