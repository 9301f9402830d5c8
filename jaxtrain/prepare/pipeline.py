"""Text in, token shards out: the library behind `jaxtrain prepare`.

How it keeps its promises:
- Deterministic: the inputs are cut into units independently of the process count
  (jaxtrain.prepare.readers), results are written in unit order, and a shard closes at the first
  unit boundary past `tokens_per_file`; the manifest holds no times or absolute paths.
- Resumable: work goes to `OUT.partial/` with the layout (inputs, sizes, options, tokenizer);
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
from jaxtrain.errors import ConfigError, DataError, require_package
from jaxtrain.prepare import bpe, chat_template, readers, remote, workers
from jaxtrain.prepare import request as request_lib
from jaxtrain.prepare.chat import ChatSpec
from jaxtrain.prepare.formats import FORMATS, hf
from jaxtrain.prepare.records import BAD, Input, Options, Unit
from jaxtrain.prepare.request import Request
from jaxtrain.prepare.shards import Report, ShardWriter, UnitResult, committed
from jaxtrain.prepare.work import FileUnits, StreamedRows


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the layout ----------------------------------------------------------------------------

@dataclasses.dataclass
class InputLayout:
    """What one prepare reads and writes: its inputs laid out as work (units of files or
    streamed rows), the dataset directory it completes and what that output depends on."""

    inputs: list[Input]
    work: FileUnits | StreamedRows
    out: pathlib.Path  # the dataset directory this prepare completes (or its URL)
    identity: dict  # what the output depends on; its hash names the plan
    tokenizer: tokenizers_lib.Tokenizer | None = None  # given (None: to be trained)
    skipped: dict = dataclasses.field(default_factory=dict)  # files left out (discover)
    # {local cache folder: the gs:// or s3:// URL it holds a copy of} (remote.fetch_inputs)
    shown: dict = dataclasses.field(default_factory=dict)

    @property
    def units(self) -> list[Unit]:
        return self.work.units

    @property
    def options(self) -> Options:
        return self.work.options

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
            if FORMATS[self.inputs[unit.first].format].lines:
                starts[unit.first] = unit.start
        return {index: start for index, start in starts.items() if start > 0}

    @property
    def plan_id(self) -> str:
        """The hash of the identity (the manifest's `plan_id`)."""
        return hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()


def layout_inputs(r: Request) -> InputLayout:
    """Checks the request, finds its inputs and lays them out as work; the one place that
    tells a streamed dataset from files."""
    request_lib.check(r)
    # --chat finds its template now, so that a tokenizer without one stops it before any
    # input is fetched
    tokenizer = tokenizers_lib.load_tokenizer(r.tokenizer.spec) if r.chat.enabled else None
    reading = _reading(r, tokenizer)
    out = storage.as_path(r.output.path, "--out")
    skipped, shown = {}, {}
    if r.inputs.hf_dataset is not None and not _saved_dataset(r.inputs.hf_dataset):
        inputs = [Input(r.inputs.hf_dataset, hf.STREAM, 0)]
        require_package(hf.PACKAGE, f"--hf-dataset={r.inputs.hf_dataset}", error=DataError)
        if r.run.shard is not None:
            raise DataError("--shard splits input files; a streamed dataset has none")
        work = StreamedRows(r.inputs.hf_dataset, r.inputs.hf_config, reading,
                            r.output.unit_bytes)
    else:
        patterns, shown = remote.fetch_inputs(r.inputs.paths or [r.inputs.hf_dataset],
                                              r.run.progress)
        inputs, skipped = readers.discover(patterns, r.inputs.format, r.inputs.include_hidden,
                                           r.inputs.include_binary)
        readers.require_packages(inputs)
        span = None
        if r.run.shard is not None:
            i, n = r.run.shard
            span = readers.part_span(inputs, i, n)
            out = out / f"part-{i:05d}-of-{n:05d}"
            if i != 0:
                skipped = {}  # every part finds the same ones: part 0 reports them, once
        work = FileUnits(inputs, readers.plan_units(inputs, reading, r.output.unit_bytes,
                                                    span), reading)
    layout = InputLayout(inputs, work, out, {}, None, skipped, shown)
    identity = {
        "format": fmt.FORMAT,
        "inputs": [[layout.name(item.path), item.format, item.size] for item in inputs],
        "hf": [r.inputs.hf_config, reading.split] if r.inputs.hf_dataset else None,
        "field": reading.field, "text_unit": reading.text_unit, "bos": r.output.bos,
        "eos": r.output.eos, "tokens_per_file": r.output.tokens_per_file,
        "unit_bytes": r.output.unit_bytes, "shard": list(r.run.shard) if r.run.shard else None,
    }
    if reading.chat is not None:  # absent otherwise: plans made before --chat stay valid
        identity["chat"] = reading.chat.identity()
    if r.tokenizer.train is not None:
        identity["tokenizer"] = {"train": r.tokenizer.train}
    else:  # what the tokenizer is, not where: a changed file at the same path is a new plan
        tokenizer = tokenizer or tokenizers_lib.load_tokenizer(r.tokenizer.spec)
        identity["tokenizer"] = {"fingerprint": tokenizer.fingerprint()}
    return dataclasses.replace(layout, identity=identity, tokenizer=tokenizer)


def _saved_dataset(name: str) -> bool:
    """--hf-dataset names a `save_to_disk` directory (on disk, or a gs:// or s3:// prefix,
    then fetched into the input cache like any input), not a hub name to stream."""
    try:
        return hf.is_saved(storage.as_path(name, "--hf-dataset"))
    except ConfigError:  # a URL of another scheme (hf://): for datasets to stream
        return False


def _reading(r: Request, tokenizer) -> Options:
    """How the records are read: with --chat, the chat template found for the tokenizer
    (DataError, one line, when it has none) goes with the options to the workers."""
    if not r.chat.enabled:
        return r.reading
    template = chat_template.find(r.chat.template, r.tokenizer.spec, tokenizer)
    tokenizer.encode_rendered("")  # a kind without character offsets refuses now, not later
    return dataclasses.replace(r.reading, chat=ChatSpec(template, r.chat.train_on,
                                                        r.chat.max_length,
                                                        r.chat.preference))


# --- the report ----------------------------------------------------------------------------

# --- the tokenizer -------------------------------------------------------------------------

def _tokenizer(layout: InputLayout, request: Request,
               directory: pathlib.Path) -> tokenizers_lib.Tokenizer:
    """The layout's tokenizer, saved in `directory` (reused there when a rerun resumes)."""
    if tokenizers_lib.read_meta(directory) is not None:
        return tokenizers_lib.load_tokenizer(directory)
    if request.tokenizer.train is not None:
        say(f"jaxtrain: training a byte-level BPE of {request.tokenizer.train} ids on the "
            "inputs")
        tokenizer = bpe.train_bpe(layout.work.documents(), request.tokenizer.train,
                                  length=layout.work.count(),
                                  show_progress=request.run.progress)
    else:
        tokenizer = layout.tokenizer
    chat = layout.options.chat  # its template beside the tokenizer, committed with it
    tokenizer.save(directory, {chat_template.TEMPLATE_FILE: chat.template.source} if chat
                   else None)
    return tokenizer


def _special_ids(tokenizer: tokenizers_lib.Tokenizer, request: Request) -> dict:
    """The BOS/EOS policy: auto adds EOS when the tokenizer has one, and BOS when it has one
    that differs from its EOS (Llama-style); yes/no force it, yes failing without the id.
    With --chat none: the template writes the special tokens."""
    if request.chat.enabled:
        return {"bos": None, "eos": None}
    chosen = {}
    for role, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
        policy = getattr(request.output, role)
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

def _results(layout: InputLayout, request: Request, start_unit: int, records_start: int,
             worker_args: tuple) -> Iterator[tuple[int, int, UnitResult]]:
    """(unit index, records consumed after it, result) in unit order, from a pool of worker
    processes with a bounded number of units in flight."""
    tasks = layout.work.tasks(start_unit, records_start)
    processes = layout.work.processes(request.run.processes or _cpus(), start_unit)
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

    def __init__(self, layout: InputLayout, enabled: bool, done_bytes: int):
        self.bar = tqdm(total=layout.work.total_bytes(), initial=done_bytes, unit="B",
                        unit_scale=True, unit_divisor=1024, desc="prepare",
                        disable=not enabled, file=sys.stderr, dynamic_ncols=True)
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


def _process(layout: InputLayout, request: Request, tokenizer, staging: pathlib.Path,
             special: dict, dtype: str) -> tuple[list[dict], Report]:
    records = committed(staging)
    start_unit = records[-1]["units"][1] if records else 0
    records_start = records[-1]["records_end"] if records else 0
    report = (Report.from_json(layout.inputs, records[-1]["report"], records[-1]["lines_before"],
                               layout.line_starts)
              if records else Report(layout.inputs, layout.line_starts, layout.skipped))
    if records:
        say(f"jaxtrain: resuming {staging}: {len(records)} shard(s) done, continuing at unit "
            f"{start_unit}")
    done_bytes = layout.work.done_bytes(start_unit)
    progress = _Progress(layout, request.run.progress, done_bytes)
    writer = None
    worker_args = (str(staging / fmt.TOKENIZER_DIR), layout.inputs, layout.options,
                   special["bos"], special["eos"], dtype)
    try:
        for k, records_end, result in _results(layout, request, start_unit, records_start,
                                               worker_args):
            if writer is None:
                writer = ShardWriter(staging, len(records), k, dtype,
                                     masked=layout.options.chat is not None)
            writer.add(k, result)
            writer.records_end = records_end
            report.add(layout.work.input_of(k), result)
            progress.update(result, report.totals["documents"])
            _check_bad(report, request.run.max_bad_fraction, False, request.reading.field)
            if writer.num_tokens >= request.output.tokens_per_file:
                records.append(writer.commit(report))
                writer = None
        if writer is not None:
            records.append(writer.commit(report))
            writer = None
    finally:
        if writer is not None:
            writer.abandon()
        rate = progress.close()
    _check_bad(report, request.run.max_bad_fraction, True, request.reading.field)
    say(f"jaxtrain: {report.summary()} ({rate:,.0f} tokens/s)")
    if report.replaced_warning():
        say(f"jaxtrain: warning: {report.replaced_warning()}")
    return records, report


# --- finishing -----------------------------------------------------------------------------

def _manifest(layout: InputLayout, tokenizer, special: dict, dtype: str, shards: list[dict],
              report: Report, request: Request) -> dict:
    entries = [{"tokens": s["tokens"], "index": s["index_file"], "num_tokens": s["num_tokens"],
                "num_documents": s["num_documents"], "sha256": s["sha256"],
                "stream": s["stream"], **({"mask": s["mask"]} if "mask" in s else {})}
               for s in shards]
    policy = {"bos": special["bos"] is not None, "eos": special["eos"] is not None}
    spec = layout.options.chat
    options = {"field": request.reading.field, "text_unit": request.reading.text_unit,
               "hf_config": request.inputs.hf_config, "split": request.reading.split}
    chat = {}
    if spec is not None:
        options["chat"] = spec.identity()
        chat = {"chat": {**spec.identity(), "template": f"{fmt.TOKENIZER_DIR}/"
                                                        f"{chat_template.TEMPLATE_FILE}"}}
        if spec.preference:  # documents 2k, 2k + 1 are pair k (data/pairs.py)
            chat["pairs"] = True
    return {
        "format": fmt.FORMAT,
        "fingerprint": fmt.content_fingerprint(dtype, tokenizer.fingerprint(), policy, entries),
        "plan_id": layout.plan_id,
        "dtype": dtype,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in shards),
        "text_bytes": report.totals["text_bytes"],
        "tokenizer": tokenizer.meta(),
        "policy": {**policy, "bos_id": special["bos"], "eos_id": special["eos"]},
        "sources": [{"path": layout.name(item.path), "format": item.format, "bytes": item.size}
                    for item in layout.inputs],
        "options": options,
        **chat,
        "shards": entries,
        "report": _named(report.to_json(), layout),
        **({"part": list(request.run.shard)} if request.run.shard else {}),
    }


def _named(report: dict, layout: InputLayout) -> dict:
    """The report with the places it names in fetched inputs named by their URLs."""
    if not layout.shown:
        return report
    for value in [*report["skipped"].values(), report["invalid_utf8_replaced"]]:
        value["first"] = [layout.name(where) for where in value["first"]]
    return report


def write_json(path: pathlib.Path, value: dict) -> None:
    storage.write_json(path, value, indent=1, sort_keys=True)


def _check_out(out, overwrite: bool, layout: InputLayout) -> dict | None:
    """The existing manifest when OUT already holds this very dataset, else None (also with
    `overwrite`); refuses to replace what is not a prepared dataset, and, without
    `overwrite`, a dataset prepared from other inputs or options. OUT without the manifest
    that holds only what a prepare writes is an interrupted commit (None)."""
    names = remote.listing(out, "--out")
    if fmt.MANIFEST not in names:
        if remote.foreign(names) is not None:
            raise DataError(f"--out={out} holds files that are not a prepared dataset "
                            f"(first: {remote.foreign(names)}); choose another --out "
                            "(nothing there is replaced)")
        return None
    if overwrite:
        return None
    with remote.errors("--out", out):
        existing = json.loads((out / fmt.MANIFEST).read_text())
    if existing.get("plan_id") == layout.plan_id:
        return existing
    raise DataError(f"--out={out} already holds a dataset prepared from "
                    f"{_made_from(existing, layout)}: give --overwrite to replace it, or choose "
                    "another --out")


def _made_from(existing: dict, layout: InputLayout) -> str:
    """What the dataset at OUT was made from, said against this layout."""
    sources = existing.get("sources", [])
    fingerprint = f"fingerprint {str(existing.get('fingerprint'))[:12]}"
    ours = [layout.name(i.path) for i in layout.inputs]
    if [[s["path"], s["bytes"]] for s in sources] == [[p, i.size] for p, i in
                                                       zip(ours, layout.inputs)]:
        return f"these inputs with other options or another tokenizer ({fingerprint})"
    paths = [s["path"] for s in sources]
    named = ", ".join(paths[:2]) + (f" and {len(paths) - 2:,} more" if len(paths) > 2 else "")
    changed = ", whose sizes have changed since" if paths == ours else ""
    return f"other inputs ({named or 'none'}{changed}; {fingerprint})"


def prepare(request: Request) -> dict:
    """Prepares (or resumes, or finds already prepared) a dataset; returns its manifest."""
    layout = layout_inputs(request)
    if request.tokenizer.only:
        return _tokenizer_only(layout, request)
    existing = _check_out(layout.out, request.output.overwrite, layout)
    if existing is not None:
        say(f"jaxtrain: {layout.out} is already prepared from these inputs and options "
            "(--overwrite to prepare it again)")
        return existing
    manifest = _prepare(layout, request)
    say(f"jaxtrain: wrote {layout.out} ({manifest['num_documents']:,} documents, "
        f"{manifest['num_tokens']:,} tokens, {len(manifest['shards'])} shard(s), fingerprint "
        f"{manifest['fingerprint'][:12]})")
    return manifest


def _prepare(layout: InputLayout, request: Request) -> dict:
    """Prepares (or resumes) the layout in its staging directory (storage.staging_dir:
    OUT.partial beside a local OUT, this host's scratch for a bucket), then commits it to
    OUT, the manifest last; one finished by an earlier run (killed during its commit) is
    committed as it is."""
    remote.check_writable(layout.out, "--out")
    staging = storage.staging_dir(layout.out, "prepare")
    manifest = None if request.output.overwrite else _finished(staging, layout)
    if manifest is not None:
        say(f"jaxtrain: {staging} holds this dataset, prepared; committing it to {layout.out}")
    else:
        manifest = _prepare_staged(layout, request, staging)
    remote.publish(staging, layout.out, "--out", request.run.progress)
    return manifest


def _finished(staging: pathlib.Path, layout: InputLayout) -> dict | None:
    """The manifest of a prepare of this layout finished in `staging`, or None."""
    if not (staging / fmt.MANIFEST).is_file():
        return None
    manifest = json.loads((staging / fmt.MANIFEST).read_text())
    return manifest if manifest.get("plan_id") == layout.plan_id else None


def _prepare_staged(layout: InputLayout, request: Request, staging: pathlib.Path) -> dict:
    """Prepares (or resumes) the layout into `staging`, the manifest written last."""
    plan_file = staging / "plan.json"
    if staging.exists() and (not plan_file.is_file()
                             or json.loads(plan_file.read_text()) != layout.identity):
        say(f"jaxtrain: {staging} holds an unfinished prepare of other inputs or options; "
            "starting over")
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        (staging / fmt.FAILED).unlink(missing_ok=True)  # this attempt may well succeed
        if not plan_file.is_file():
            write_json(plan_file, layout.identity)
        tokenizer = _tokenizer(layout, request, staging / fmt.TOKENIZER_DIR)
        dtype = fmt.dtype_for(tokenizer.vocab_size)
        special = _special_ids(tokenizer, request)
        shards, report = _process(layout, request, tokenizer, staging, special, dtype)
        if not report.totals["documents"]:
            if request.run.shard is None:
                raise DataError(f"the inputs hold no documents: {report.summary()}")
            # --merge counts every part's documents; one part may hold none, when its bytes
            # lie inside a record that starts before them (a whole-file document, a .gz)
            say(f"jaxtrain: part {request.run.shard[0]}/{request.run.shard[1]} holds no documents "
                f"({report.summary()}); it is complete, and --merge takes it as such")
        manifest = _manifest(layout, tokenizer, special, dtype, shards, report, request)
        plan_file.unlink()  # the manifest says what was made; the layout was for resuming
        write_json(staging / fmt.MANIFEST, manifest)
    except Exception as e:
        error = _out_of_disk(e, staging, layout.out)
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


def _tokenizer_only(layout: InputLayout, request: Request) -> dict:
    """The tokenizer alone, trained in a staging directory, then committed to OUT (its meta
    file last)."""
    names = remote.listing(layout.out, "--out")
    if names and tokenizers_lib.META_FILE not in names and remote.foreign(names) is not None:
        raise DataError(f"--out={layout.out} holds files that are not a tokenizer (first: "
                        f"{remote.foreign(names)}); choose another --out")
    remote.check_writable(layout.out, "--out")
    staging = storage.staging_dir(layout.out, "tokenizer")
    shutil.rmtree(staging, ignore_errors=True)  # trained again: a rerun is no resume
    tokenizer = _tokenizer(layout, request, staging)
    remote.publish(staging, layout.out, "--out", request.run.progress,
                   last=tokenizers_lib.META_FILE)
    say(f"jaxtrain: wrote {tokenizer.describe()} to {layout.out}")
    return tokenizer.meta()


# --- merging the parts of a multi-machine prepare -------------------------------------------
