"""Tokenizing throughput of `jaxtrain prepare` against Hugging Face `datasets`, side by side.

    python scripts/bench_prepare.py [--processes 1,2] [--rounds 3] [--vocab 4096]
        [--tokenizer DIR] [--markdown]

Both sides tokenize the same files (this Python's standard library, each file one document)
with the same byte-level BPE (trained here once, or --tokenizer) through the same call
(`tokenizers.Tokenizer.encode_batch_fast`), one thread per process
(TOKENIZERS_PARALLELISM=false), N processes:
- ours: `jaxtrain.data.prepare.prepare(...)` from the files to a finished dataset directory
  (read, decode, tokenize, write shards and index, manifest);
- theirs: `datasets.load_dataset("text", sample_by="document", encoding_errors="replace")`
  (a few stdlib files are not UTF-8) then
  `.map(tokenize, batched=True, num_proc=N)` into a fresh cache (reported with and without
  the load step).
Runs alternate (ours, theirs, ours, ...) and each figure is the median over rounds, so the
ratios are measured side by side under the same load. Tokens/s counts the BPE tokens of the
text (ours also writes one EOS per document; not counted).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported anywhere

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxtrain.data import prepare as prepare_lib  # noqa: E402
from jaxtrain.data.stdlib import stdlib_files  # noqa: E402
from jaxtrain.data.tokenizers import HF_FILE, load_tokenizer  # noqa: E402


def ours(files: list[str], tokenizer_dir: str, processes: int, work: pathlib.Path) -> float:
    out = work / f"ours_{processes}"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    prepare_lib.prepare(prepare_lib.Request(inputs=files, out=str(out), tokenizer=tokenizer_dir,
                                            processes=processes, progress=False))
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return seconds


def _tokenize_with(path: str):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(path)
    tok.encode_special_tokens = True  # as jaxtrain's HFTokenizer encodes documents

    def tokenize(batch):
        encodings = tok.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"ids": [e.ids for e in encodings]}
    return tokenize


def theirs(files: list[str], tokenizer_dir: str, processes: int,
           work: pathlib.Path) -> tuple[float, float, int]:
    """(seconds with loading, seconds of the map alone, tokens)."""
    import datasets

    datasets.disable_progress_bars()
    cache = work / f"hf_cache_{processes}"
    shutil.rmtree(cache, ignore_errors=True)
    tokenize = _tokenize_with(str(pathlib.Path(tokenizer_dir) / HF_FILE))
    start = time.perf_counter()
    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                               encoding_errors="replace", cache_dir=str(cache))
    mapped_at = time.perf_counter()
    out = ds.map(tokenize, batched=True, num_proc=None if processes == 1 else processes,
                 remove_columns=["text"])
    end = time.perf_counter()
    tokens = sum(len(ids) for ids in out["ids"])
    shutil.rmtree(cache, ignore_errors=True)
    return end - start, end - mapped_at, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokenizer", help="a saved tokenizer directory (default: train one)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    files = [str(p) for p in stdlib_files()]
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        tokenizer_dir = str(work / "tokenizer")
        prepare_lib.prepare(prepare_lib.Request(inputs=files, out=tokenizer_dir,
                                                train_tokenizer=args.vocab, tokenizer_only=True,
                                                progress=False))
    tokenizer = load_tokenizer(tokenizer_dir)
    text_bytes = sum(os.path.getsize(f) for f in files)
    counts = [int(n) for n in args.processes.split(",")]
    times: dict = {(side, n): [] for n in counts for side in ("ours", "hf", "hf_map")}
    tokens = 0
    for _ in range(args.rounds):
        for n in counts:
            times[("ours", n)].append(ours(files, tokenizer_dir, n, work))
            total, mapped, tokens = theirs(files, tokenizer_dir, n, work)
            times[("hf", n)].append(total)
            times[("hf_map", n)].append(mapped)
    shutil.rmtree(work, ignore_errors=True)
    rate = {key: tokens / statistics.median(values) for key, values in times.items()}
    print(f"{len(files)} files, {text_bytes / 1e6:.1f} MB, {tokens:,} tokens "
          f"({tokenizer.describe()}), median of {args.rounds} rounds, {os.cpu_count()} CPUs")
    rows = ["| processes | ours tokens/s | datasets load+map | datasets map only | ours ÷ "
            "load+map | ours ÷ map only | ours N ÷ ours 1 |", "|---|---|---|---|---|---|---|"]
    for n in counts:
        rows.append(f"| {n} | {rate[('ours', n)]:,.0f} | {rate[('hf', n)]:,.0f} | "
                    f"{rate[('hf_map', n)]:,.0f} | {rate[('ours', n)] / rate[('hf', n)]:.2f}× | "
                    f"{rate[('ours', n)] / rate[('hf_map', n)]:.2f}× | "
                    f"{rate[('ours', n)] / rate[('ours', counts[0])]:.2f}× |")
    print("\n".join(rows) if args.markdown else "\n".join(r.replace("|", " ") for r in rows))


if __name__ == "__main__":
    main()
