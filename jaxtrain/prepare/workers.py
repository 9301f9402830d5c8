"""The worker side of `jaxtrain prepare`: each spawned process loads the tokenizer once
(`init`), then reads and tokenizes the units (`work_unit`) or streamed rows (`work_rows`) it
is handed and returns their ids with the counts and stream hashes (shards.UnitResult). A
worker ends with the prepare that spawned it, even when that one is killed.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

import numpy as np

from jaxtrain.data import fingerprints
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.prepare import chat, preference, readers, records
from jaxtrain.prepare.shards import UnitResult

_WORKER: dict = {}


def init(tokenizer_dir: str, inputs: list[records.Input], options: records.Options,
                 bos: int | None, eos: int | None, dtype: str) -> None:
    # One thread per process: processes are the parallelism, and a forked/spawned process
    # must not start a second thread pool per core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=tokenizers_lib.load_tokenizer(tokenizer_dir), inputs=inputs,
                   options=options, bos=bos, eos=eos, dtype=np.dtype(dtype))


def init_spawned(*worker_args) -> None:
    _die_with_parent()
    init(*worker_args)


def _die_with_parent() -> None:
    """Ends this worker when the prepare that spawned it ends, even by SIGKILL (which runs
    no clean-up there, so the pool cannot stop it): on Linux the kernel sends it SIGKILL
    (prctl PR_SET_PDEATHSIG); elsewhere a thread waits on the pipe from the parent that
    closes when the parent dies. Once the workers are gone, the resource tracker they shared
    with the parent sees its pipe close and exits too."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent.pid:  # the parent died before the prctl
                    os._exit(1)
                return
        except (OSError, AttributeError):  # no libc or no prctl: the pipe below
            pass
    threading.Thread(target=_exit_when_closed, args=(parent.sentinel,), daemon=True,
                     name="jaxtrain-parent-watch").start()


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _exit_when_closed(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _tokenize(docs: list[str], tally: records.Tally, size: int) -> UnitResult:
    w = _WORKER
    encoded = w["tokenizer"].encode_batch(docs) if docs else []
    pieces, lengths = [], np.empty(len(docs), dtype=np.int64)
    bos = None if w["bos"] is None else np.asarray([w["bos"]], dtype=w["dtype"])
    eos = None if w["eos"] is None else np.asarray([w["eos"]], dtype=w["dtype"])
    for k, ids in enumerate(encoded):
        if bos is not None:
            pieces.append(bos)
        pieces.append(ids.astype(w["dtype"], copy=False))
        if eos is not None:
            pieces.append(eos)
        lengths[k] = len(ids) + (bos is not None) + (eos is not None)
        tally.text_bytes += len(docs[k].encode("utf-8"))
    tokens = np.concatenate(pieces) if pieces else np.empty(0, dtype=w["dtype"])
    stream = {"tokens": fingerprints.stream_hash(tokens),
              "lengths": fingerprints.stream_hash(lengths)}
    return UnitResult(tokens, lengths, tally, size, stream)


def _tokenize_chat(docs: list[tuple], tally: records.Tally, size: int) -> UnitResult:
    """Chat records (with their locations) -> ids and loss mask; bad ones are counted."""
    w, spec = _WORKER, _WORKER["options"].chat
    ids, masks, lengths = [], [], []
    for record, where in docs:
        try:
            documents, text_bytes = _encode(_clean(record, tally, where), spec,
                                            w["tokenizer"])
        except chat.BadRecord as bad:
            tally.note(bad.kind, where)
            continue
        for record_ids, mask in documents:  # a preference pair: two, kept adjacent
            ids.append(record_ids.astype(w["dtype"], copy=False))
            masks.append(mask)
            lengths.append(len(record_ids))
            tally.documents += 1
        tally.text_bytes += text_bytes
    tokens = np.concatenate(ids) if ids else np.empty(0, dtype=w["dtype"])
    mask = np.concatenate(masks) if masks else np.empty(0, dtype=np.uint8)
    lengths = np.asarray(lengths, dtype=np.int64)
    stream = {"tokens": fingerprints.stream_hash(tokens),
              "lengths": fingerprints.stream_hash(lengths),
              "mask": fingerprints.stream_hash(mask)}
    return UnitResult(tokens, lengths, tally, size, stream, mask)


def _encode(record, spec: chat.ChatSpec, tokenizer) -> tuple[list[tuple], int]:
    """([(ids, mask), ...] documents of one record, text bytes): a conversation is one
    document, a preference record two (chosen, rejected); chat.BadRecord."""
    if spec.preference:
        return preference.encode_pair(record, spec, tokenizer)
    ids, mask, text_bytes = chat.encode(record, spec, tokenizer)
    return [(ids, mask)], text_bytes


def _clean(record, tally: records.Tally, where: tuple):
    """The record with lone surrogates replaced in its strings (records.encodable)."""
    if isinstance(record, str):
        return records.encodable(record, tally, where)
    if isinstance(record, list):
        return [_clean(v, tally, where) for v in record]
    if isinstance(record, dict):
        return {k: _clean(v, tally, where) for k, v in record.items()}
    return record


def _work(docs: list, tally: records.Tally, size: int) -> UnitResult:
    if _WORKER["options"].chat is not None:
        return _tokenize_chat(docs, tally, size)
    return _tokenize(docs, tally, size)


def work_unit(unit: records.Unit) -> UnitResult:
    tally = records.Tally()
    docs = readers.read_unit(unit, _WORKER["inputs"], _WORKER["options"], tally)
    return _work(docs, tally, unit.size)


def work_rows(rows: tuple[int, list]) -> UnitResult:
    first_row, batch = rows
    tally = records.Tally()
    options = _WORKER["options"]
    docs = readers.read_stream_rows(batch, options.field, first_row, tally,
                                    chat=options.chat is not None)
    result = _work(docs, tally, 0)
    result.size = tally.text_bytes  # no file sizes to count progress in: text bytes instead
    return result
