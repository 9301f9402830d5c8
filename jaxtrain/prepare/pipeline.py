"""Text in, token shards out: the library behind `jaxtrain prepare`.

How it keeps its promises:
- Deterministic: the inputs are cut into units independently of the process count
  (jaxtrain.prepare.readers), results are written in unit order, and a shard closes at the first
  unit boundary past `tokens_per_file`; the manifest holds no times or absolute paths.
- Resumable: work goes to `OUT.partial/` with the plan (inputs, sizes, options, tokenizer);
  each shard is written to temporary names and committed by renaming its data and then its
  record (`shard-K.json`) last. A rerun of the same command keeps the committed shards and
  continues at the first unit after them.
- Never half-readable: the manifest is written last, then OUT.partial replaces OUT. Until
  then OUT (a previous complete dataset, if any) is untouched, including when the disk fills.
  A complete OUT made from other inputs or options is replaced only with `overwrite`; a
  prepare that fails leaves its error in OUT.partial/failed.json for whoever reads OUT next.
- Parallel: units are tokenized by worker processes (spawned, each single-threaded, ending
  with their parent even when it is killed), at most a few units in flight so memory stays
  bounded; the main process only writes.
- Past one machine: `shard=(i, n)` prepares the records that start in the i-th of n equal
  byte ranges of the inputs laid end to end (readers.plan_units) into OUT/part-i-of-n/
  (SLURM arrays, Kubernetes indexed jobs); `merge(OUT)` (jaxtrain.prepare.merge) then writes
  one manifest over the parts' shards without copying tokens, with the fingerprint of a
  one-machine prepare (dataset.content_fingerprint). The staged shards themselves are
  jaxtrain.prepare.shards.
- On object storage (gs://, s3://): inputs are downloaded to a local cache, and an --out URL
  is prepared into a local stand-in as above, then uploaded with the manifest last, the
  commit marker (jaxtrain.prepare.remote).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import hashlib
import json
import multiprocessing
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Iterator

from tqdm import tqdm

from jaxtrain import storage
from jaxtrain.data import dataset as fmt
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.errors import DataError
from jaxtrain.prepare import bpe, readers, remote, workers
from jaxtrain.prepare.formats import hf
from jaxtrain.prepare.records import BAD, TEXT_UNITS, Input, Options, Tally, Unit
from jaxtrain.prepare.shards import Report, ShardWriter, UnitResult, committed

POLICIES = ("auto", "yes", "no")


@dataclasses.dataclass
class Request:
    """One prepare: the command's options."""

    inputs: list[str]
    out: str
    tokenizer: str | None = None
    train_tokenizer: int | None = None
    tokenizer_only: bool = False
    field: str = "text"
    format: str = "auto"
    include_hidden: bool = False  # files and directories whose name starts with "."
    include_binary: bool = False  # text files that readers.is_binary
    text_unit: str = "file"
    hf_dataset: str | None = None
    hf_config: str | None = None
    split: str = "train"
    bos: str = "auto"
    eos: str = "auto"
    processes: int = 0  # 0: one per CPU
    shard: tuple[int, int] | None = None
    tokens_per_file: int = 1 << 27
    unit_bytes: int = 1 << 20
    max_bad_fraction: float = 0.01
    overwrite: bool = False
    progress: bool = True


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the plan ------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    inputs: list[Input]
    units: list[Unit]
    options: Options
    out: pathlib.Path  # the dataset directory this prepare completes (or its URL)
    identity: dict  # what the output depends on; its hash names the plan
    streamed: bool = False
    tokenizer: tokenizers_lib.Tokenizer | None = None  # given (None: to be trained)
    skipped: dict = dataclasses.field(default_factory=dict)  # files left out (discover)
    # {local cache folder: the gs:// or s3:// URL it holds a copy of} (remote.fetch_inputs)
    shown: dict = dataclasses.field(default_factory=dict)

    def name(self, path: str) -> str:
        """An input's name in the manifest: its URL when it was fetched from one."""
        for local, url in self.shown.items():
            if path == local or path.startswith(local + "/"):
                return url + path[len(local):]
        return path

    @property
    def line_starts(self) -> dict[int, int]:
        """Line-based inputs whose first unit starts inside them (a part of a --shard
        prepare): index -> byte, for the report's line numbers."""
        starts = {}
        for unit in reversed(self.units):
            if self.inputs[unit.first].format in ("text", "jsonl"):
                starts[unit.first] = unit.start
        return {index: start for index, start in starts.items() if start > 0}

    @property
    def plan_id(self) -> str:
        return hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()

    @property
    def staging(self) -> pathlib.Path:
        return self.out.with_name(self.out.name + fmt.PARTIAL_SUFFIX)


def _check_request(r: Request) -> None:
    for key, value in (("--bos", r.bos), ("--eos", r.eos)):
        if value not in POLICIES:
            raise DataError(f"{key}={value} is invalid: valid values are {', '.join(POLICIES)}")
    if r.text_unit not in TEXT_UNITS:
        raise DataError(f"--text-unit={r.text_unit} is invalid: valid values are "
                        f"{', '.join(TEXT_UNITS)}")
    if (r.tokenizer is None) == (r.train_tokenizer is None):
        raise DataError("give one of --tokenizer SPEC and --train-tokenizer VOCAB")
    if r.tokenizer_only and r.train_tokenizer is None:
        raise DataError("--tokenizer-only goes with --train-tokenizer VOCAB")
    if r.train_tokenizer is not None and r.shard is not None:
        raise DataError("--train-tokenizer with --shard would train a different tokenizer on "
                        "each part: train one first (--train-tokenizer V --tokenizer-only) and "
                        "pass it to every part with --tokenizer")
    if not 0.0 <= r.max_bad_fraction <= 1.0:
        raise DataError(f"--max-bad-fraction={r.max_bad_fraction} is invalid: between 0 and 1")
    if r.tokens_per_file < 1 or r.unit_bytes < 1:
        raise DataError("--tokens-per-file and --unit-bytes must be >= 1")
    if bool(r.inputs) == bool(r.hf_dataset):
        raise DataError("give input files, or --hf-dataset NAME, not both or neither")
    if r.shard is not None:
        i, n = r.shard
        if not 0 <= i < n:
            raise DataError(f"--shard={i}/{n} is invalid: i/N with 0 <= i < N")


def make_plan(r: Request) -> Plan:
    _check_request(r)
    options = Options(field=r.field, text_unit=r.text_unit, split=r.split)
    out = storage.as_path(r.out, "--out")
    streamed, skipped, shown = False, {}, {}
    if r.hf_dataset is not None and not hf.is_saved(pathlib.Path(r.hf_dataset)):
        inputs = [Input(r.hf_dataset, hf.STREAM, 0)]
        streamed = True
    else:
        patterns, shown = remote.fetch_inputs(r.inputs or [r.hf_dataset], r.progress)
        inputs, skipped = readers.discover(patterns, r.format, r.include_hidden,
                                           r.include_binary)
        if r.shard is not None and r.shard[0] != 0:
            skipped = {}  # every part finds the same ones: part 0 reports them, once
    readers.require_packages(inputs)
    span = None
    if r.shard is not None:
        if streamed:
            raise DataError("--shard splits input files; a streamed dataset has none")
        i, n = r.shard
        span = readers.part_span(inputs, i, n)
        out = out / f"part-{i:05d}-of-{n:05d}"
    units = [] if streamed else readers.plan_units(inputs, options, r.unit_bytes, span)
    plan = Plan(inputs, units, options, out, {}, streamed, None, skipped, shown)
    identity = {
        "format": fmt.FORMAT,
        "inputs": [[plan.name(item.path), item.format, item.size] for item in inputs],
        "hf": [r.hf_config, r.split] if r.hf_dataset else None,
        "field": r.field, "text_unit": r.text_unit, "bos": r.bos, "eos": r.eos,
        "tokens_per_file": r.tokens_per_file, "unit_bytes": r.unit_bytes,
        "shard": list(r.shard) if r.shard else None,
    }
    tokenizer = None
    if r.train_tokenizer is not None:
        identity["tokenizer"] = {"train": r.train_tokenizer}
    else:  # what the tokenizer is, not where: a changed file at the same path is a new plan
        tokenizer = tokenizers_lib.load_tokenizer(r.tokenizer)
        identity["tokenizer"] = {"fingerprint": tokenizer.fingerprint()}
    return dataclasses.replace(plan, identity=identity, tokenizer=tokenizer)


# --- the report ----------------------------------------------------------------------------

# --- the tokenizer -------------------------------------------------------------------------

def _documents_for_training(plan: Plan, request: Request) -> Iterator[str]:
    if plan.streamed:
        for _, rows in _stream_batches(plan, request, 0):
            yield from readers.read_stream_rows(rows, plan.options.field, 0, Tally())
        return
    for unit in plan.units:
        yield from readers.read_unit(unit, plan.inputs, plan.options, Tally())


def _tokenizer(plan: Plan, request: Request, directory: pathlib.Path) -> tokenizers_lib.Tokenizer:
    """The plan's tokenizer, saved in `directory` (reused there when a rerun resumes)."""
    if tokenizers_lib.read_meta(directory) is not None:
        return tokenizers_lib.load_tokenizer(directory)
    if request.train_tokenizer is not None:
        say(f"jaxtrain: training a byte-level BPE of {request.train_tokenizer} ids on the "
            "inputs")
        tokenizer = bpe.train_bpe(
            _documents_for_training(plan, request), request.train_tokenizer,
            length=None if plan.streamed else sum(u.last - u.first for u in plan.units),
            show_progress=request.progress)
    else:
        tokenizer = plan.tokenizer
    tokenizer.save(directory)
    return tokenizer


def _special_ids(tokenizer: tokenizers_lib.Tokenizer, request: Request) -> dict:
    """The BOS/EOS policy: auto adds EOS when the tokenizer has one, and BOS when it has one
    that differs from its EOS (Llama-style); yes/no force it, yes failing without the id."""
    chosen = {}
    for role, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
        policy = getattr(request, role)
        if policy == "yes" and token_id is None:
            raise DataError(f"--{role}=yes: the tokenizer ({tokenizer.describe()}) has no "
                            f"{role.upper()} token")
        if policy == "auto":
            use = token_id is not None and not (role == "bos" and token_id == tokenizer.eos_id)
        else:
            use = policy == "yes"
        chosen[role] = token_id if use else None
    return chosen


# --- running -------------------------------------------------------------------------------

def _stream_batches(plan: Plan, request: Request, skip: int) -> Iterator[tuple[int, list]]:
    """(first row, rows) of a streamed Hugging Face dataset, about unit_bytes at a time."""
    try:
        import datasets
    except ImportError:
        raise DataError("--hf-dataset needs the datasets package: pip install "
                        "'jaxtrain[data]'") from None
    try:
        stream = datasets.load_dataset(request.hf_dataset, name=request.hf_config,
                                       split=request.split, streaming=True)
    except Exception as e:  # noqa: BLE001 - hub, network and builder errors vary widely
        raise DataError(f"--hf-dataset={request.hf_dataset}: cannot be loaded "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if skip:
        stream = stream.skip(skip)
    rows, size, first = [], 0, skip
    for row in stream:
        rows.append(row)
        value = row.get(request.field) if isinstance(row, dict) else None
        size += len(value) if isinstance(value, str) else 1
        if size >= request.unit_bytes:
            yield first, rows
            first, rows, size = first + len(rows), [], 0
    if rows:
        yield first, rows


def _results(plan: Plan, request: Request, start_unit: int, records_start: int,
             worker_args: tuple) -> Iterator[tuple[int, int, UnitResult]]:
    """(unit index, records consumed after it, result) in unit order, from a pool of worker
    processes with a bounded number of units in flight."""
    if plan.streamed:
        tasks = ((k, first + len(rows), workers.work_rows, (first, rows)) for k, (first, rows)
                 in enumerate(_stream_batches(plan, request, records_start), start=start_unit))
    else:
        tasks = ((k, 0, workers.work_unit, plan.units[k])
                 for k in range(start_unit, len(plan.units)))
    processes = request.processes or _cpus()
    if not plan.streamed:
        processes = min(processes, max(len(plan.units) - start_unit, 1))
    if processes == 1:
        previous = os.environ.get("TOKENIZERS_PARALLELISM")
        workers.init(*worker_args)
        try:
            for k, records, work, payload in tasks:
                yield k, records, work(payload)
        finally:
            if previous is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous
        return
    context = multiprocessing.get_context("spawn")  # the parent may hold threads (tokenizers)
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context,
                                                initializer=workers.init_spawned,
                                                initargs=worker_args) as pool:
        pending = collections.deque()
        for k, records, work, payload in tasks:
            pending.append((k, records, pool.submit(work, payload)))
            if len(pending) >= 2 * processes:
                k0, r0, future = pending.popleft()
                yield k0, r0, future.result()
        while pending:
            k0, r0, future = pending.popleft()
            yield k0, r0, future.result()


def _cpus() -> int:
    """CPUs this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Progress:
    """A tqdm bar over input bytes (ETA) showing documents and tokens/s."""

    def __init__(self, plan: Plan, enabled: bool, done_bytes: int):
        total = None if plan.streamed else sum(u.size for u in plan.units)
        self.bar = tqdm(total=total, initial=done_bytes, unit="B", unit_scale=True,
                        unit_divisor=1024, desc="prepare", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True)
        self.start, self.tokens, self.docs = time.perf_counter(), 0, 0

    def update(self, result: UnitResult, documents: int) -> None:
        self.tokens += len(result.tokens)
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{documents:,} docs, {rate:,.0f} tokens/s", refresh=False)
        self.bar.update(result.size or 0)

    def close(self) -> float:
        self.bar.close()
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)


def _check_bad(report: Report, limit: float, final: bool, field: str) -> None:
    records, bad = report.totals["records"], report.bad()
    if not records or bad / records <= limit or (not final and records < 1000):
        return
    first = [loc for kind in BAD for loc in report.first.get(kind, [])][:3]
    hint = report.field_hint(field) or "fix the input or raise --max-bad-fraction"
    raise DataError(f"{bad:,} of {records:,} records were unusable ({bad / records:.2%}, over "
                    f"--max-bad-fraction={limit}): {report.summary()}; first: "
                    f"{', '.join(first)}; {hint}")


def _process(plan: Plan, request: Request, tokenizer, staging: pathlib.Path,
             special: dict, dtype: str) -> tuple[list[dict], Report]:
    records = committed(staging)
    start_unit = records[-1]["units"][1] if records else 0
    records_start = records[-1]["records_end"] if records else 0
    report = (Report.from_json(plan.inputs, records[-1]["report"], records[-1]["lines_before"],
                               plan.line_starts)
              if records else Report(plan.inputs, plan.line_starts, plan.skipped))
    if records:
        say(f"jaxtrain: resuming {staging}: {len(records)} shard(s) done, continuing at unit "
            f"{start_unit}")
    done_bytes = sum(u.size for u in plan.units[:start_unit])
    progress = _Progress(plan, request.progress, done_bytes)
    writer = None
    worker_args = (str(staging / fmt.TOKENIZER_DIR), plan.inputs, plan.options,
                   special["bos"], special["eos"], dtype)
    try:
        for k, records_end, result in _results(plan, request, start_unit, records_start,
                                               worker_args):
            if writer is None:
                writer = ShardWriter(staging, len(records), k, dtype)
            writer.add(k, result)
            writer.records_end = records_end
            report.add(plan.units[k].first if not plan.streamed else 0, result)
            progress.update(result, report.totals["documents"])
            _check_bad(report, request.max_bad_fraction, False, request.field)
            if writer.num_tokens >= request.tokens_per_file:
                records.append(writer.commit(report))
                writer = None
        if writer is not None:
            records.append(writer.commit(report))
            writer = None
    finally:
        if writer is not None:
            writer.abandon()
        rate = progress.close()
    _check_bad(report, request.max_bad_fraction, True, request.field)
    say(f"jaxtrain: {report.summary()} ({rate:,.0f} tokens/s)")
    if report.replaced_warning():
        say(f"jaxtrain: warning: {report.replaced_warning()}")
    return records, report


# --- finishing -----------------------------------------------------------------------------

def _manifest(plan: Plan, tokenizer, special: dict, dtype: str, shards: list[dict],
              report: Report, request: Request) -> dict:
    entries = [{"tokens": s["tokens"], "index": s["index_file"], "num_tokens": s["num_tokens"],
                "num_documents": s["num_documents"], "sha256": s["sha256"],
                "stream": s["stream"]} for s in shards]
    policy = {"bos": special["bos"] is not None, "eos": special["eos"] is not None}
    return {
        "format": fmt.FORMAT,
        "fingerprint": fmt.content_fingerprint(dtype, tokenizer.fingerprint(), policy, entries),
        "plan_id": plan.plan_id,
        "dtype": dtype,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in shards),
        "text_bytes": report.totals["text_bytes"],
        "tokenizer": tokenizer.meta(),
        "policy": {**policy, "bos_id": special["bos"], "eos_id": special["eos"]},
        "sources": [{"path": plan.name(item.path), "format": item.format, "bytes": item.size}
                    for item in plan.inputs],
        "options": {"field": request.field, "text_unit": request.text_unit,
                    "hf_config": request.hf_config, "split": request.split},
        "shards": entries,
        "report": _named(report.to_json(), plan),
        **({"part": list(request.shard)} if request.shard else {}),
    }


def _named(report: dict, plan: Plan) -> dict:
    """The report with the places it names in fetched inputs named by their URLs."""
    if not plan.shown:
        return report
    for value in [*report["skipped"].values(), report["invalid_utf8_replaced"]]:
        value["first"] = [plan.name(where) for where in value["first"]]
    return report


def write_json(path: pathlib.Path, value: dict) -> None:
    storage.write_json(path, value, indent=1, sort_keys=True)


def _publish(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Puts the finished staging directory at `out`; a previous dataset there goes only
    once the new one is complete and in place."""
    old = None
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_out(out, overwrite: bool, plan: Plan) -> dict | None:
    """The existing manifest when OUT already holds this very dataset, else None (also with
    `overwrite`); refuses to replace a directory that is not a prepared dataset, and,
    without `overwrite`, a dataset prepared from other inputs or options. On object
    storage, a prefix without the manifest that holds only what a prepare writes is an
    interrupted upload (None)."""
    manifest = out / fmt.MANIFEST
    if storage.is_remote(out):
        names = remote.listing(out, "--out")
        if fmt.MANIFEST not in names:
            if remote.foreign(names) is not None:
                raise DataError(f"--out={out} holds objects that are not a prepared dataset "
                                f"(first: {remote.foreign(names)}); choose another --out "
                                "(nothing there is replaced)")
            return None
    elif not out.exists():
        return None
    elif not manifest.is_file():
        raise DataError(f"--out={out} exists and is not a prepared dataset; choose another "
                        "--out (nothing there is replaced)")
    if overwrite:
        return None
    with remote.errors("--out", out):
        existing = json.loads(manifest.read_text())
    if existing.get("plan_id") == plan.plan_id:
        return existing
    raise DataError(f"--out={out} already holds a dataset prepared from "
                    f"{_made_from(existing, plan)}: give --overwrite to replace it, or choose "
                    "another --out")


def _made_from(existing: dict, plan: Plan) -> str:
    """What the dataset at OUT was made from, said against this plan."""
    sources = existing.get("sources", [])
    fingerprint = f"fingerprint {str(existing.get('fingerprint'))[:12]}"
    ours = [plan.name(i.path) for i in plan.inputs]
    if [[s["path"], s["bytes"]] for s in sources] == [[p, i.size] for p, i in
                                                       zip(ours, plan.inputs)]:
        return f"these inputs with other options or another tokenizer ({fingerprint})"
    paths = [s["path"] for s in sources]
    named = ", ".join(paths[:2]) + (f" and {len(paths) - 2:,} more" if len(paths) > 2 else "")
    changed = ", whose sizes have changed since" if paths == ours else ""
    return f"other inputs ({named or 'none'}{changed}; {fingerprint})"


def prepare(request: Request) -> dict:
    """Prepares (or resumes, or finds already prepared) a dataset; returns its manifest."""
    plan = make_plan(request)
    if request.tokenizer_only:
        return _tokenizer_only(plan, request)
    existing = _check_out(plan.out, request.overwrite, plan)
    if existing is not None:
        say(f"jaxtrain: {plan.out} is already prepared from these inputs and options "
            "(--overwrite to prepare it again)")
        return existing
    if storage.is_remote(plan.out):
        manifest = _prepare_remote(plan, request)
    else:
        manifest = _prepare_here(plan, request)
    say(f"jaxtrain: wrote {plan.out} ({manifest['num_documents']:,} documents, "
        f"{manifest['num_tokens']:,} tokens, {len(manifest['shards'])} shard(s), fingerprint "
        f"{manifest['fingerprint'][:12]})")
    return manifest


def _prepare_remote(plan: Plan, request: Request) -> dict:
    """Prepares into a local directory standing in for the remote --out, then uploads it
    (jaxtrain.prepare.remote); one finished there by an earlier run is uploaded as it is."""
    remote.check_writable(plan.out, "--out")
    scratch = storage.scratch_dir(plan.out, "prepare")
    local = scratch / "dataset"
    manifest = None
    if (local / fmt.MANIFEST).is_file() and not request.overwrite:
        manifest = json.loads((local / fmt.MANIFEST).read_text())
        if manifest.get("plan_id") == plan.plan_id:
            say(f"jaxtrain: {local} holds this dataset, prepared; uploading it")
        else:
            manifest = None
    if manifest is None:
        shutil.rmtree(local, ignore_errors=True)  # another dataset: a local stand-in only
        manifest = _prepare_here(dataclasses.replace(plan, out=local), request)
    remote.publish(local, plan.out, "--out", request.progress)
    shutil.rmtree(scratch, ignore_errors=True)
    return manifest


def _prepare_here(plan: Plan, request: Request) -> dict:
    """Prepares (or resumes) the plan into its local OUT.partial, then puts it at OUT."""
    staging = plan.staging
    plan_file = staging / "plan.json"
    if staging.exists() and (not plan_file.is_file()
                             or json.loads(plan_file.read_text()) != plan.identity):
        say(f"jaxtrain: {staging} holds an unfinished prepare of other inputs or options; "
            "starting over")
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        (staging / fmt.FAILED).unlink(missing_ok=True)  # this attempt may well succeed
        if not plan_file.is_file():
            write_json(plan_file, plan.identity)
        tokenizer = _tokenizer(plan, request, staging / fmt.TOKENIZER_DIR)
        dtype = fmt.dtype_for(tokenizer.vocab_size)
        special = _special_ids(tokenizer, request)
        shards, report = _process(plan, request, tokenizer, staging, special, dtype)
        if not report.totals["documents"]:
            if request.shard is None:
                raise DataError(f"the inputs hold no documents: {report.summary()}")
            # --merge counts every part's documents; one part may hold none, when its bytes
            # lie inside a record that starts before them (a whole-file document, a .gz)
            say(f"jaxtrain: part {request.shard[0]}/{request.shard[1]} holds no documents "
                f"({report.summary()}); it is complete, and --merge takes it as such")
        manifest = _manifest(plan, tokenizer, special, dtype, shards, report, request)
        plan_file.unlink()  # the manifest says what was made; the plan was for resuming
        write_json(staging / fmt.MANIFEST, manifest)
        _publish(staging, plan.out)
    except Exception as e:
        error = _out_of_disk(e, staging, plan.out)
        _note_failure(staging, error or e)
        if error is not None:
            raise error from None
        raise
    return manifest


def _out_of_disk(e: Exception, staging: pathlib.Path, out: pathlib.Path) -> DataError | None:
    if not isinstance(e, OSError) or e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    previous = (f"the previous dataset at {out} is intact" if out.exists()
                else f"nothing was written to {out}")
    return DataError(f"out of disk space writing {staging}: {previous}; the finished shards "
                     f"stay in {staging}: free space and run the same command to continue")


def _note_failure(staging: pathlib.Path, e: Exception) -> None:
    """Leaves the error beside the unfinished work, so that a run pointed at OUT says what
    failed rather than "run the same command again" (which would fail the same way)."""
    if not staging.is_dir():
        return
    message = str(e) if isinstance(e, DataError) else f"{type(e).__name__}: {e}"
    try:
        write_json(staging / fmt.FAILED, {"error": message.splitlines()[0] if message else
                                          type(e).__name__})
    except OSError:  # e.g. the disk that is full: the error itself still reaches the user
        pass


def _tokenizer_only(plan: Plan, request: Request) -> dict:
    out = plan.out
    if storage.is_remote(out):
        return _tokenizer_only_remote(plan, request)
    if out.exists() and tokenizers_lib.read_meta(out) is None and any(out.iterdir()):
        raise DataError(f"--out={out} exists and is not a tokenizer directory; choose another")
    tmp = out.with_name(out.name + fmt.PARTIAL_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = _tokenizer(plan, request, tmp)
    _publish(tmp, out)
    say(f"jaxtrain: wrote {tokenizer.describe()} to {out}")
    return tokenizer.meta()


def _tokenizer_only_remote(plan: Plan, request: Request) -> dict:
    """The tokenizer trained in local scratch, then uploaded (its meta file last)."""
    names = remote.listing(plan.out, "--out")
    if names and tokenizers_lib.META_FILE not in names and remote.foreign(names) is not None:
        raise DataError(f"--out={plan.out} holds objects that are not a tokenizer (first: "
                        f"{remote.foreign(names)}); choose another --out")
    remote.check_writable(plan.out, "--out")
    scratch = storage.scratch_dir(plan.out, "tokenizer")
    shutil.rmtree(scratch / "tokenizer", ignore_errors=True)  # trained again, as locally
    tokenizer = _tokenizer(plan, request, scratch / "tokenizer")
    remote.publish(scratch / "tokenizer", plan.out, "--out", request.progress,
                   last=tokenizers_lib.META_FILE)
    shutil.rmtree(scratch, ignore_errors=True)
    say(f"jaxtrain: wrote {tokenizer.describe()} to {plan.out}")
    return tokenizer.meta()


# --- merging the parts of a multi-machine prepare -------------------------------------------
