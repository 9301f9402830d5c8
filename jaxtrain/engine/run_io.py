"""What a command needs of a run to generate with it: its EOS ids (generation_config.json
plus the tokenizer's EOS token), its chat template rendered into prompt ids, and the JSON
Lines of --prompts in and out."""

from __future__ import annotations

import json
import pathlib

import jinja2

from jaxtrain import storage
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.hf import generation
from jaxtrain.prepare import chat_template as templates
from jaxtrain.workdir import TOKENIZER_DIR


def eos_ids(workdir, tokenizer) -> tuple[int, ...]:
    """Where a reply ends: the run's generation_config.json EOS ids and its tokenizer's."""
    ids = list(generation.read(workdir).eos_ids)
    if tokenizer is not None and tokenizer.eos_id is not None and tokenizer.eos_id not in ids:
        ids.append(tokenizer.eos_id)
    return tuple(ids)


def chat_template(workdir, tokenizer, option: str | None = None):
    """The run's chat template (or --chat_template FILE|NAME); DataError (one line) for a
    run without one or without a tokenizer."""
    if tokenizer is None:
        raise DataError("--chat needs the model's tokenizer, and this run has none")
    directory = storage.local_copy(storage.as_path(workdir, "--workdir") / TOKENIZER_DIR,
                                   "--workdir", "tokenizer")
    return templates.find(option, str(directory), tokenizer)


def chat_ids(template, tokenizer, messages: list[dict]) -> list[int]:
    """The conversation rendered with the generation prompt, tokenized as transformers'
    apply_chat_template tokenizes it (text spelling a special token is that token)."""
    try:
        text = template.render(messages, add_generation_prompt=True)
    except jinja2.TemplateError as e:
        raise DataError(f"the chat template refuses these messages: {e}") from None
    if tokenizer.kind == "bytes":  # no special tokens: the bytes are the ids
        return tokenizer.encode(text)
    return [int(i) for i in tokenizer.encode_rendered(text)[0]]


def read_prompts(path: str) -> list[dict]:
    """--prompts FILE.jsonl: one JSON object a line with "prompt" (text), "prompt_ids"
    (ids) or "messages" (a chat), and optionally its own sampling keys."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise DataError(f"--prompts={path}: no such file")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"--prompts={path} line {number}: not JSON ({e})") from None
        keys = [k for k in ("prompt", "prompt_ids", "messages") if k in row] \
            if isinstance(row, dict) else []
        if len(keys) != 1:
            raise DataError(f"--prompts={path} line {number}: give exactly one of prompt, "
                            "prompt_ids, messages")
        rows.append(row)
    if not rows:
        raise ConfigError(f"--prompts={path}: holds no prompts")
    return rows
