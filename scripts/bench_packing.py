"""Packed chat rows of a small dataset: real tokens per second before and after the last
window was cut to its rows that hold anything (issue #35 item 13).

    PYTHONPATH=. python scripts/bench_packing.py [--conversations 30] [--steps 8]

Prepares `--conversations` chats of about 270 bytes (bytes tokenizer, ChatML: ~8k tokens)
and packs them at seq 640 twice: as before (every window 64 rows, so one window of mostly
padding rows) and as now (data/packing.py). Both train the same compiled step of
configs/tiny.py's model cut to 2 layers of width 64 (global batch 8) for `--steps` steps,
alternating; prints each variant's rows, real-token fraction (slots holding a document) and
real tokens per second (those slots over the median step time × steps). About 15 s on a
busy 2-core CPU, most of it start-up and the compile.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import jax
import numpy as np

from jaxtrain.config import apply_overrides, load_config_file
from jaxtrain.data.batches import Batches, to_global
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.data.packing import PackedDocuments, row_arrays
from jaxtrain.prepare import pipeline as P
from jaxtrain.train.setup import build


class Before(PackedDocuments):
    """The packer as it was: every window ROWS_PER_WINDOW rows, empty ones included."""

    def __len__(self) -> int:
        return self.windows * self.rows

    def __getitem__(self, index: int):
        w, r = divmod(index % len(self), self.rows)
        return row_arrays(self._plan(w)[r], self.dataset.read, self.capacity,
                          self.dataset.read_mask if self.masked else None)


def _dataset(directory: pathlib.Path, conversations: int) -> PreparedDataset:
    rng = np.random.default_rng(0)
    words = "the a of to model data row token train pack window chat reply".split()
    with open(directory / "chats.jsonl", "w") as f:
        for _ in range(conversations):
            say = [" ".join(rng.choice(words, int(rng.integers(8, 40)))) for _ in range(2)]
            f.write(json.dumps({"prompt": say[0], "completion": say[1]}) + "\n")
    P.prepare(P.Request.build(inputs=[str(directory / "chats.jsonl")],
                              out=str(directory / "ds"), progress=False, processes=1,
                              tokenizer="bytes", chat=True, chat_template="chatml"))
    return PreparedDataset(directory / "ds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    cfg = apply_overrides(load_config_file("configs/tiny.py"), {
        "model.seq_len": 640, "train.global_batch": 8, "data.packing": "documents",
        "data.source": "synthetic", "model.num_layers": 2, "model.d_model": 64,
        "model.mlp_dim": 256})
    with tempfile.TemporaryDirectory() as tmp:
        ds = _dataset(pathlib.Path(tmp), args.conversations)
        seq, batch = cfg.model.seq_len, cfg.train.global_batch
        variants = {name: cls(ds, 0, ds.num_tokens, seq, name, masked=True)
                    for name, cls in (("before", Before), ("after", PackedDocuments))}
        setup = build(cfg, jax.devices()[:1])
        state = setup.init_state()
        streams = {name: Batches(rows, rows, batch, 0, 2, 1).train_iter(0)
                   for name, rows in variants.items()}
        batches = {name: [to_global(next(it), setup.tokens_sharding)
                          for _ in range(args.steps)] for name, it in streams.items()}
        with jax.set_mesh(setup.mesh):
            step = setup.train_step().lower(state, batches["after"][0]).compile()
            times = {name: [] for name in variants}
            for i in range(args.steps):
                for name in variants:
                    start = time.perf_counter()
                    state, metrics = step(state, batches[name][i])
                    jax.block_until_ready(metrics)
                    times[name].append(time.perf_counter() - start)
    print(f"{ds.num_documents} conversations, {ds.num_tokens:,} tokens, seq {seq}, "
          f"batch {batch}, {args.steps} steps each on {jax.devices()[0].platform}")
    rate = {}
    for name, rows in variants.items():
        real = sum(int((np.asarray(b.segments) != 0).sum()) for b in batches[name])
        fraction = real / (args.steps * batch * (seq + 1))
        rate[name] = real / (float(np.median(times[name])) * args.steps)
        print(f"{name:<7} {len(rows):3d} rows  real-token fraction {fraction:6.1%}  "
              f"step median {np.median(times[name]) * 1e3:7.1f} ms  "
              f"real tokens/s {rate[name]:10,.0f}")
    print(f"after/before real tokens/s: {rate['after'] / rate['before']:.2f}x")


if __name__ == "__main__":
    main()
