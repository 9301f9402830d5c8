"""One manifest over the parts of a prepare split across machines (`jaxtrain prepare
--merge OUT` after `--shard i/N` jobs): tokens are not copied, only referenced. OUT may be
a gs:// or s3:// prefix the parts were uploaded under: the merge then reads the parts'
manifests and writes the merged one (last, the commit marker) there, and copies nothing
but the small tokenizer files."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

from jaxtrain import storage
from jaxtrain.data import dataset as fmt
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.errors import DataError
from jaxtrain.prepare import records, remote
from jaxtrain.prepare.pipeline import say, write_json


def merge(directory) -> dict:
    """One manifest over OUT/part-*-of-N (each a finished `--shard i/N` prepare): tokens are
    not copied; the parts must agree on tokenizer, policy and dtype."""
    directory = storage.as_path(directory, "--merge")
    with remote.errors("--merge", directory):
        return _merge(directory)


def _merge(directory) -> dict:
    parts = part_names(directory)
    if not parts:
        raise DataError(f"--merge={directory}: no part-I-of-N directories in it")
    total = int(parts[0].rsplit("-", 1)[1])
    read = {f"part-{i:05d}-of-{total:05d}": _part_manifest(directory, i, total)
            for i in range(total)}
    missing = [name for name, manifest in read.items() if manifest is None]
    if missing:
        raise DataError(f"--merge={directory}: {len(missing)} of {total} parts are not finished "
                        f"(first: {missing[0]}); run their prepare first")
    manifests = list(read.values())
    _check_parts(manifests)
    if not sum(m["num_documents"] for m in manifests):
        raise DataError(f"--merge={directory}: the inputs hold no documents (every part is "
                        "empty)")
    first = manifests[0]
    shards = [{**s, **{key: f"part-{i:05d}-of-{total:05d}/{s[key]}" if s[key] else None
                       for key in ("tokens", "index", "mask") if key in s}}
              for i, m in enumerate(manifests) for s in m["shards"]]
    policy = {"bos": first["policy"]["bos"], "eos": first["policy"]["eos"]}
    merged = {**{k: v for k, v in first.items() if k != "part"},
              "fingerprint": fmt.content_fingerprint(first["dtype"],
                                                     first["tokenizer"]["fingerprint"], policy,
                                                     shards),
              "plan_id": hashlib.sha256("".join(m["plan_id"] for m in manifests).encode())
              .hexdigest(),
              "num_tokens": sum(m["num_tokens"] for m in manifests),
              "num_documents": sum(m["num_documents"] for m in manifests),
              "text_bytes": sum(m["text_bytes"] for m in manifests),
              "sources": first["sources"],  # every part lists all inputs (checked)
              "shards": shards,
              "report": _merge_reports([m["report"] for m in manifests]),
              "parts": total}
    _copy_tokenizer(directory / next(iter(read)) / fmt.TOKENIZER_DIR,
                    directory / fmt.TOKENIZER_DIR)
    write_json(directory / fmt.MANIFEST, merged)
    say(f"jaxtrain: merged {total} parts into {directory} ({merged['num_documents']:,} "
        f"documents, {merged['num_tokens']:,} tokens)")
    return merged


def part_names(directory) -> list[str]:
    """The names of the part directories (prefixes) in `directory` that hold files, sorted
    (a part's OUT.partial staging beside them is not one)."""
    tops = {name.split("/", 1)[0] for name in storage.listing(directory) if "/" in name}
    return sorted(name for name in tops if re.fullmatch(r"part-\d+-of-\d+", name))


def _part_manifest(directory, i: int, total: int) -> dict | None:
    """Part i's manifest, or None while the part is not finished (no manifest yet)."""
    path = directory / f"part-{i:05d}-of-{total:05d}" / fmt.MANIFEST
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None


def _copy_tokenizer(source, target) -> None:
    """The first part's tokenizer as the dataset's: its files copied into a staging
    directory, then committed (storage.commit_files: the meta file last)."""
    staged = storage.staging_dir(target, "tokenizer")
    shutil.rmtree(staged, ignore_errors=True)
    storage.download_tree(source, staged, f"the tokenizer of {source}")
    storage.commit_files(staged, target, tokenizers_lib.META_FILE)


def _check_parts(manifests: list[dict]) -> None:
    first, total = manifests[0], len(manifests)
    for i, m in enumerate(manifests):
        if m.get("part") != [i, total] or any("stream" not in s for s in m["shards"]):
            raise DataError(f"--merge: part {i} was not prepared as part {i}/{total} by this "
                            "version of jaxtrain prepare (parts are byte ranges of all the "
                            "inputs); prepare it again with --shard")
    for i, m in enumerate(manifests[1:], start=1):
        if m["tokenizer"]["fingerprint"] != first["tokenizer"]["fingerprint"]:
            raise DataError(f"--merge: part {i} was prepared with tokenizer "
                            f"{m['tokenizer']['fingerprint'][:12]}, part 0 with "
                            f"{first['tokenizer']['fingerprint'][:12]}; prepare every part "
                            "with one --tokenizer")
        if m["sources"] != first["sources"]:
            differ = next((b["path"] for a, b in zip(first["sources"], m["sources"]) if a != b),
                          f"{len(m['sources'])} inputs against {len(first['sources'])}")
            raise DataError(f"--merge: part {i} was prepared from other inputs than part 0 "
                            f"(first difference: {differ}); give every part the same inputs")
        for key in ("dtype", "policy", "options"):
            if m[key] != first[key]:
                raise DataError(f"--merge: part {i} has {key} {m[key]} but part 0 has "
                                f"{first[key]}; prepare every part with the same options")


def _merge_reports(reports: list[dict]) -> dict:
    merged = {k: sum(r[k] for r in reports) for k in ("records", "documents", "tokens",
                                                      "text_bytes")}

    def combine(values: list[dict]) -> dict:
        first = [loc for v in values for loc in v["first"]][:records.FIRST_KEPT]
        return {"count": sum(v["count"] for v in values), "first": first}

    kinds = [k for k in records.SKIPS + records.CHAT_SKIPS
             if any(k in r["skipped"] for r in reports)]
    empty = {"count": 0, "first": []}
    merged["skipped"] = {k: combine([r["skipped"].get(k, empty) for r in reports])
                         for k in kinds}
    merged["invalid_utf8_replaced"] = combine([r["invalid_utf8_replaced"] for r in reports])
    return merged
