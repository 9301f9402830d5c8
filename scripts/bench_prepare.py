"""Tokenizing throughput of `jaxtrain prepare` against Hugging Face `datasets`, side by side.

    python scripts/bench_prepare.py [--processes 1,2] [--rounds 3] [--max-mb MB]
        [--vocab 4096] [--tokenizer DIR] [--markdown]

Both sides tokenize the same files (this Python's standard library, each file one document;
--max-mb: the first files in path order up to MB megabytes) with the same byte-level BPE
(trained here once, or --tokenizer) through the same call
(`tokenizers.Tokenizer.encode_batch_fast`), one thread per process
(TOKENIZERS_PARALLELISM=false), N processes:
- ours: `jaxtrain.prepare.pipeline.prepare(...)` from the files to a finished dataset directory
  (read, decode, tokenize, write shards and index, manifest);
- theirs: `datasets.load_dataset("text", sample_by="document", encoding_errors="replace")`
  (a few stdlib files are not UTF-8) then
  `.map(tokenize, batched=True, num_proc=N)` into a fresh cache (reported with and without
  the load step).
Runs alternate (ours, theirs, ours, ...) and each figure is the median over rounds, so the
ratios are measured side by side under the same load. Tokens/s counts the BPE tokens of the
text (ours also writes one EOS per document; not counted).

Scaling needs idle cores, so each row also shows the 1-minute load average during its runs
and the cores the runs got (CPU seconds of the process and its reaped workers ÷ wall
seconds). With the kernel's autogroup scheduling (Linux default on desktops and many VMs),
CPU is shared between sessions, not processes: while other sessions keep the cores busy a
second process gets no more CPU, and N processes cannot beat one — the cores column shows it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported anywhere

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxtrain.data.stdlib import stdlib_files  # noqa: E402
from jaxtrain.data.tokenizers import HF_FILE, load_tokenizer  # noqa: E402
from jaxtrain.prepare import pipeline as prepare_lib  # noqa: E402


def cpu_seconds() -> float:
    """User + system CPU of this process and of its finished (reaped) children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def ours(files: list[str], tokenizer_dir: str, processes: int, work: pathlib.Path) -> dict:
    out = work / f"ours_{processes}"
    shutil.rmtree(out, ignore_errors=True)
    load, cpu, start = os.getloadavg()[0], cpu_seconds(), time.perf_counter()
    prepare_lib.prepare(prepare_lib.Request.build(inputs=files, out=str(out),
                                                  tokenizer=tokenizer_dir,
                                                  processes=processes, progress=False))
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return {"seconds": seconds, "cpu": cpu_seconds() - cpu, "load": load}


def _tokenize_with(path: str):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(path)
    tok.encode_special_tokens = True  # as jaxtrain's HFTokenizer encodes documents

    def tokenize(batch):
        encodings = tok.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"ids": [e.ids for e in encodings]}
    return tokenize


def theirs(files: list[str], tokenizer_dir: str, processes: int, work: pathlib.Path) -> dict:
    """Seconds with loading, seconds of the map alone, CPU seconds, tokens."""
    import datasets

    datasets.disable_progress_bars()
    cache = work / f"hf_cache_{processes}"
    shutil.rmtree(cache, ignore_errors=True)
    tokenize = _tokenize_with(str(pathlib.Path(tokenizer_dir) / HF_FILE))
    load, cpu, start = os.getloadavg()[0], cpu_seconds(), time.perf_counter()
    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                               encoding_errors="replace", cache_dir=str(cache))
    mapped_at = time.perf_counter()
    out = ds.map(tokenize, batched=True, num_proc=None if processes == 1 else processes,
                 remove_columns=["text"])
    end = time.perf_counter()
    result = {"seconds": end - start, "map": end - mapped_at, "cpu": cpu_seconds() - cpu,
              "load": load, "tokens": sum(len(ids) for ids in out["ids"])}
    shutil.rmtree(cache, ignore_errors=True)
    return result


def _files(max_mb: float | None) -> list[str]:
    files, total = [], 0
    for path in stdlib_files():
        if max_mb is not None and total >= max_mb * 1e6:
            break
        files.append(str(path))
        total += path.stat().st_size
    return files


def _scheduler() -> str:
    try:
        autogroup = pathlib.Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "scheduler: no autogroup setting (not Linux?)"
    if autogroup == "1":
        return ("scheduler: autogroup on (CPU shared between sessions: with other sessions "
                "busy, N processes get no more CPU than one; see the cores columns)")
    return "scheduler: autogroup off (CPU shared between processes)"


def table(counts: list[int], runs: dict, tokens: int) -> list[str]:
    def median(side, n, key):
        return statistics.median(r[key] for r in runs[(side, n)])

    rate = {(s, n): tokens / median(s, n, "seconds") for s in ("ours", "hf") for n in counts}
    mapped = {n: tokens / median("hf", n, "map") for n in counts}
    rows = ["| processes | ours tokens/s | datasets load+map | datasets map only | ours ÷ "
            "load+map | ours ÷ map only | ours N ÷ ours 1 | datasets N ÷ datasets 1 | cores "
            "got: ours, datasets | load average |", "|---|---|---|---|---|---|---|---|---|---|"]
    one = counts[0]
    for n in counts:
        ours_rate, hf_rate = rate[("ours", n)], rate[("hf", n)]
        cores = [median(s, n, "cpu") / median(s, n, "seconds") for s in ("ours", "hf")]
        loads = [r["load"] for s in ("ours", "hf") for r in runs[(s, n)]]
        rows.append(f"| {n} | {ours_rate:,.0f} | {hf_rate:,.0f} | {mapped[n]:,.0f} | "
                    f"{ours_rate / hf_rate:.2f}× | {ours_rate / mapped[n]:.2f}× | "
                    f"{ours_rate / rate[('ours', one)]:.2f}× | "
                    f"{hf_rate / rate[('hf', one)]:.2f}× | {cores[0]:.2f}, {cores[1]:.2f} | "
                    f"{min(loads):.1f}–{max(loads):.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-mb", type=float, help="only the first files, up to MB megabytes")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokenizer", help="a saved tokenizer directory (default: train one)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    files = _files(args.max_mb)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        tokenizer_dir = str(work / "tokenizer")
        prepare_lib.prepare(prepare_lib.Request.build(inputs=files, out=tokenizer_dir,
                                                      train_tokenizer=args.vocab,
                                                      tokenizer_only=True, progress=False))
    tokenizer = load_tokenizer(tokenizer_dir)
    text_bytes = sum(os.path.getsize(f) for f in files)
    counts = [int(n) for n in args.processes.split(",")]
    runs: dict = {(side, n): [] for n in counts for side in ("ours", "hf")}
    load_at_start, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M")
    tokens = 0
    for _ in range(args.rounds):
        for n in counts:
            runs[("ours", n)].append(ours(files, tokenizer_dir, n, work))
            runs[("hf", n)].append(theirs(files, tokenizer_dir, n, work))
            tokens = runs[("hf", n)][-1]["tokens"]
    shutil.rmtree(work, ignore_errors=True)
    print(f"{started}–{time.strftime('%H:%M')}: {len(files)} files, {text_bytes / 1e6:.1f} MB, "
          f"{tokens:,} tokens ({tokenizer.describe()}), median of {args.rounds} rounds, "
          f"{len(os.sched_getaffinity(0))} CPUs; load average (1, 5, 15 min) "
          f"{', '.join(f'{x:.2f}' for x in load_at_start)} at the start, "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    print(_scheduler())
    rows = table(counts, runs, tokens)
    print("\n".join(rows) if args.markdown else "\n".join(r.replace("|", " ") for r in rows))


if __name__ == "__main__":
    main()
