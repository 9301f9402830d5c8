"""`jaxtrain prepare ... --ray [ADDRESS]`: the parts of a `--shard` prepare run as Ray
tasks, then merged (Levanter builds its caches on Ray the same way).

A part (`--shard i/N`, jaxtrain.prepare.pipeline) is already the unit a task needs: it
reads its own byte range of the inputs and writes a complete dataset of its own under
OUT/part-i-of-N/ through the I/O layer (a local path, which on a many-node cluster must be a
shared disk, or a gs:// or s3:// prefix, uploaded with its manifest last). The driver only
hands out the parts, counts them done on a progress bar and merges (jaxtrain.prepare.merge:
no token copied), so the result has the fingerprint of a one-shot prepare of the same
inputs, whatever N.

- Retried: a task that fails for any reason but the user's (an object store's lost
  connection, a worker or node that died) runs again, up to `retries` times; a user error
  (a bad input, a missing package: JaxtrainError) is not, as it would fail the same way.
- Resumable: a part's own prepare resumes its committed shards and leaves a finished part
  alone, so a rerun after the driver was killed redoes nothing finished; N stays what the
  parts already in OUT say.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys

from tqdm import tqdm

from jaxtrain import retry, storage
from jaxtrain.data import dataset as fmt
from jaxtrain.errors import DataError, JaxtrainError, require_package
from jaxtrain.prepare import merge as merge_lib
from jaxtrain.prepare import pipeline, remote
from jaxtrain.prepare import request as request_lib
from jaxtrain.prepare.request import Request

INSTALL = "pip install 'jaxtrain[ray]'"
RETRIES = 3  # a task's reruns after a failure that is not the user's
# How long the driver tries to reach a cluster's address before it says so in one line
# (Ray's own client retries for minutes, printing only "Failed to connect to GCS").
CONNECT_ENV = "JAXTRAIN_RAY_CONNECT_S"
CONNECT_S = 10.0


def check_address(address: str) -> None:
    """DataError (one line) unless something answers at `address` ("HOST:PORT", or
    "ray://HOST:PORT" for Ray Client; "auto" and "local" are Ray's own words, passed on)
    within $JAXTRAIN_RAY_CONNECT_S seconds: before ray.init, which would wait minutes."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[1] if address.startswith("ray://") else address
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DataError(f"--ray {address}: not a cluster address; give HOST:PORT (the head "
                        "node's GCS address, e.g. 10.0.0.5:6379), ray://HOST:PORT, or auto")
    seconds = retry.env_number(CONNECT_ENV, CONNECT_S)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except OSError as e:
        raise DataError(f"--ray {address}: no Ray cluster answers there within {seconds:g}s "
                        f"(${CONNECT_ENV}; {storage.first_line(e)}); start one with `ray start "
                        "--head`, or give its head node's address") from None


def check(request: Request) -> None:
    """DataError (one line) for what --ray cannot do, before any cluster is reached."""
    require_package("ray", "--ray", INSTALL, error=DataError)
    request_lib.check(request)
    if request.run.shard is not None:
        raise DataError("--ray runs every part itself: give --parts N, not --shard I/N")
    if request.inputs.hf_dataset is not None and not request.inputs.paths:
        raise DataError("--ray splits input files into parts; a streamed --hf-dataset has "
                        "none (save it with save_to_disk and give the directory)")
    if request.tokenizer.train is not None:
        raise DataError("--train-tokenizer with --ray would train a different tokenizer on "
                        "each part: train one first (--train-tokenizer V --tokenizer-only) and "
                        "pass it with --tokenizer")


def prepare_part(request: Request, i: int, n: int) -> tuple[str, dict | str]:
    """A Ray task's body: part i of n, prepared (or found finished, or resumed) under OUT.
    ("ok", a summary), or ("error", the line) for a user error, which is not retried."""
    part = dataclasses.replace(request, run=dataclasses.replace(
        request.run, shard=(i, n), progress=False,
        processes=request.run.processes or 1))  # Ray's tasks are the parallelism
    try:
        manifest = pipeline.prepare(part)
    except JaxtrainError as e:
        return "error", str(e)
    return "ok", {"num_documents": manifest["num_documents"],
                  "num_tokens": manifest["num_tokens"]}


def _parts(out, parts: int | None, cpus: float) -> int:
    """N: the parts OUT already holds (a rerun resumes them), else `parts`, else one per
    CPU of the cluster."""
    names = merge_lib.part_names(out)
    if names:
        found = int(names[0].rsplit("-", 1)[1])
        if parts is not None and parts != found:
            raise DataError(f"--parts={parts}: --out={out} already holds parts of {found}; "
                            f"give --parts {found} to continue them, or another --out")
        return found
    if parts is not None and parts < 1:
        raise DataError(f"--parts={parts} is invalid: at least 1")
    return parts or max(1, int(cpus))


def _check_out(out) -> None:
    """A one-shot dataset at OUT is never mixed with parts: refused (one line)."""
    with remote.errors("--out", out):
        manifest = out / fmt.MANIFEST
        existing = json.loads(manifest.read_text()) if manifest.exists() else None
    if existing is not None and "parts" not in existing:
        raise DataError(f"--out={out} holds a dataset prepared in one go; --ray writes parts "
                        "and merges them: choose another --out")


def prepare_on_ray(request: Request, address: str | None = None, parts: int | None = None,
                   task=prepare_part, retries: int = RETRIES) -> dict:
    """Prepares `request` as N Ray tasks on the cluster at `address` (None: RAY_ADDRESS, or
    a local one started here; one already initialised in this process is used as it is),
    then merges; returns the merged manifest. `task(request, i, n)` is a part's body."""
    check(request)
    import ray  # the [ray] extra: only this path needs it

    out = storage.as_path(request.output.path, "--out")
    _check_out(out)
    if address:
        check_address(address)
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, logging_level="WARNING",
                 **({} if address else {"include_dashboard": False}))
    try:
        n = _parts(out, parts, ray.cluster_resources().get("CPU", 1))
        _run(ray, request, n, task, retries)
    finally:
        if started:
            ray.shutdown()
    return merge_lib.merge(request.output.path)


def _run(ray, request: Request, n: int, task, retries: int) -> None:
    """Runs the n parts, a bar counting them done; the first that fails for good stops the
    rest with one line."""
    remote_task = ray.remote(num_cpus=1, max_retries=retries, retry_exceptions=True)(task)
    pending = {remote_task.remote(request, i, n): i for i in range(n)}
    pipeline.say(f"jaxtrain: preparing {n} part(s) on Ray into {request.output.path}")
    with tqdm(total=n, unit="part", desc="prepare (ray)", disable=not request.run.progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ref)
            try:
                kind, value = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - every retry spent: a task error, a lost node
                kind, value = "error", f"{storage.first_line(_cause(e))} (after {retries} retries)"
            if kind == "error":
                for other in pending:
                    ray.cancel(other, force=True)
                raise DataError(f"--ray: part {i}/{n} failed: {value}; the finished parts stay "
                                f"under {request.output.path}: run the same command to continue")
            bar.update(1)


def _cause(error: BaseException) -> BaseException:
    """The task's own exception inside Ray's wrapper (RayTaskError), when it has one."""
    return getattr(error, "cause", None) or error
