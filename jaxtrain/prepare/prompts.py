"""Prompt records -> a prompt set for RL (`prepare --prompts`, train.objective=grpo).

A record is `{"prompt": str | [messages], ...}` (a string is one user turn; a list is a
conversation, TRL's conversational prompt) or `{"messages": [...], ...}`, from JSON Lines
or Parquet; every other column is kept as it is, for the reward functions (an `answer`
for the `answer` reward, a test suite...). The conversation is rendered with the chat
template and its generation prompt (as `--chat` renders a conversation, chat.py, and as
`jaxtrain generate --chat` renders a prompt), then tokenized as transformers'
apply_chat_template tokenizes it.

OUT holds prompts.jsonl, one line a prompt: `prompt_ids` (the rendered ids), `prompt` (the
record's prompt as given, or its messages: what reward functions receive as `prompts`) and
the kept columns; OUT/tokenizer (with the template, as --chat saves it) and manifest.json
(`"kind": "prompts"`, the count, the columns, the template's sha256, what was skipped).
Written to OUT.partial and renamed, so OUT is whole or absent. Bad records are counted
with their first file:line (never fatal below --max-bad-fraction): malformed_json,
no_messages, unknown_role, not_text, template_error, too_long (over --max-length tokens).
"""

from __future__ import annotations

import gzip
import json
import pathlib
import shutil
import sys

import jinja2

from jaxtrain import storage
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.errors import DataError
from jaxtrain.prepare import chat, chat_template
from jaxtrain.prepare.chat import BadRecord

FILE = "prompts.jsonl"
PROMPT_KEYS = ("prompt", "messages")
KINDS = ("malformed_json", "no_messages", "unknown_role", "not_text", "template_error",
         "too_long")


def _records(path: pathlib.Path):
    """(line or row number, record or None when malformed) of a JSON Lines or Parquet
    file."""
    suffixes = [s.lower() for s in path.suffixes if s.lower() != ".gz"]
    if suffixes and suffixes[-1] == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"input {path}: Parquet needs pyarrow: pip install "
                            "'jaxtrain[data]'") from None
        yield from enumerate(pq.read_table(path).to_pylist(), 1)
        return
    if not suffixes or suffixes[-1] not in (".jsonl", ".ndjson", ".json"):
        raise DataError(f"input {path}: --prompts reads JSON Lines (.jsonl, .ndjson, .json) "
                        "or Parquet (.parquet)")
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except ValueError:
                    yield number, None


def messages_of(record) -> list[dict]:
    """The conversation a record's prompt is; BadRecord otherwise."""
    if record is None:
        raise BadRecord("malformed_json")
    if not isinstance(record, dict) or not any(record.get(k) is not None for k in PROMPT_KEYS):
        raise BadRecord("no_messages")
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRecord("no_messages")
        return [{"role": "user", "content": prompt}]
    if prompt is not None and not isinstance(prompt, list):
        raise BadRecord("not_text")
    return chat.conversation({"messages": prompt if prompt is not None
                              else record.get("messages")})


def encode_prompt(record, template, tokenizer, max_length: int | None) -> dict:
    """The prompt set's line of one record; BadRecord."""
    messages = messages_of(record)
    try:
        text = template.render(messages, add_generation_prompt=True)
    except jinja2.TemplateError:
        raise BadRecord("template_error") from None
    ids = [int(i) for i in tokenizer.encode_rendered(text)[0]]
    if max_length is not None and len(ids) > max_length:
        raise BadRecord("too_long")
    prompt = record["prompt"] if record.get("prompt") is not None else messages
    kept = {k: v for k, v in record.items() if k not in PROMPT_KEYS}
    return {"prompt_ids": ids, "prompt": prompt, **kept}


def _inputs(paths) -> list[pathlib.Path]:
    files = []
    for value in paths:
        if "://" in str(value):
            raise DataError(f"input {value}: --prompts reads local files (copy it first)")
        path = pathlib.Path(value)
        found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(
            ".")) if path.is_dir() else [path]
        if not found or not all(p.is_file() for p in found):
            raise DataError(f"input {value}: no such file")
        files += found
    if not files:
        raise DataError("--prompts needs at least one input file")
    return files


def _lines(files, template, tokenizer, max_length, skipped: dict):
    """The prompt set's lines; bad records noted in `skipped` {kind: [count, first]}."""
    for path in files:
        for number, record in _records(path):
            try:
                yield encode_prompt(record, template, tokenizer, max_length)
            except BadRecord as bad:
                entry = skipped.setdefault(bad.kind, [0, f"{path}:{number}"])
                entry[0] += 1


def prepare_prompts(paths, out, tokenizer_spec: str, template_option: str | None = None,
                    max_length: int | None = None, overwrite: bool = False,
                    max_bad_fraction: float = 0.01) -> dict:
    """Writes the prompt set of the records in `paths` to `out`; returns its manifest.
    DataError (one line) for an unusable input, tokenizer or template, for an `out` that
    holds something else (without overwrite), or for too many bad records."""
    out = pathlib.Path(out)
    if "://" in str(out):
        raise DataError(f"--out={out}: --prompts writes a local directory")
    if out.exists() and not overwrite:
        raise DataError(f"--out={out} exists: give --overwrite to replace it")
    files = _inputs(paths)
    tokenizer = tokenizers_lib.load_tokenizer(tokenizer_spec)
    template = chat_template.find(template_option, tokenizer_spec, tokenizer)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    skipped, count, columns = {}, 0, set()
    with open(partial / FILE, "w", encoding="utf-8") as f:
        for line in _lines(files, template, tokenizer, max_length, skipped):
            f.write(json.dumps(line, ensure_ascii=False, default=str) + "\n")
            count, columns = count + 1, columns | set(line)
    bad = sum(n for n, _ in skipped.values())
    for kind, (n, first) in sorted(skipped.items()):
        print(f"jaxtrain: skipped {n:,} {kind.replace('_', ' ')} (first: {first})",
              file=sys.stderr)
    if count == 0 or bad > max_bad_fraction * (bad + count):
        shutil.rmtree(partial)
        raise DataError(f"--prompts: {bad:,} of {bad + count:,} records are unusable (over "
                        f"--max-bad-fraction={max_bad_fraction}); see the lines above")
    tokenizer.save(partial / "tokenizer", {chat_template.TEMPLATE_FILE: template.source})
    manifest = {"kind": "prompts", "file": FILE, "prompts": count,
                "columns": sorted(columns - {"prompt_ids", "prompt"}),
                "template_sha256": template.sha256, "max_length": max_length,
                "tokenizer": tokenizer.meta(), "inputs": [str(p) for p in files],
                "skipped": {k: {"count": n, "first": first} for k, (n, first) in
                            skipped.items()}}
    storage.write_json(partial / "manifest.json", manifest, indent=1, sort_keys=True)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return manifest


def load_prompts(directory) -> tuple[list[dict], dict]:
    """(the prompt set's lines, its manifest) of a `prepare --prompts` output; DataError
    (one line) for a directory that is not one."""
    directory = pathlib.Path(directory)
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        raise DataError(f"{directory}: no prompt set here (no readable manifest.json: make "
                        "one with jaxtrain prepare --prompts)") from None
    if manifest.get("kind") != "prompts":
        raise DataError(f"{directory}: a dataset of tokens, not of prompts (make one with "
                        "jaxtrain prepare --prompts)")
    with open(directory / manifest["file"], encoding="utf-8") as f:
        return [json.loads(line) for line in f], manifest
