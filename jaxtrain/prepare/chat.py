"""Chat and instruction records -> token ids and a per-token loss mask (`prepare --chat`).

A record is `{"messages": [{"role", "content"}, ...]}` (roles system, user, assistant) or
`{"prompt": str, "completion": str}` (one user turn, one assistant turn). It is rendered by
the chat template (chat_template.py) and tokenized as transformers' apply_chat_template does;
no BOS/EOS is added beyond what the template writes.

The mask (1: the token is a target the loss counts) under `train_on="assistant"`:
- a template with `{% generation %}` blocks (TRL's training templates): the characters those
  blocks write, exactly as transformers' `apply_chat_template(...,
  return_assistant_tokens_mask=True)` marks them (TRL's assistant_only_loss). TRL's
  qwen2_5_training.jinja marks `'\n' + content + '<|im_end|>\n'`: the newline after
  `<|im_start|>assistant` and the one after `<|im_end|>` too.
- any other template: each assistant turn, the characters the template adds for the turn
  after its generation prompt (`render(messages[:k], add_generation_prompt=True)`) up to the
  end of `render(messages[:k + 1])`, without the whitespace that ends it. That is the reply
  and the end-of-turn token(s) the template writes after it (ChatML's `<|im_end|>`, Llama
  3's `<|eot_id|>`), but not the newline between turns, which generation never reaches (it
  stops at the end-of-turn token). For Llama 3 this equals TRL's llama3_training.jinja; for
  ChatML it is two tokens a turn fewer than TRL's Qwen training template (docs/data.md).
A token counts when any of its characters lies in such a span. `train_on="all"` counts
every token.

Bad records are counted, never fatal (the kinds below, in the prepare report with file:line).
"""

from __future__ import annotations

import dataclasses

import jinja2
import numpy as np

from jaxtrain.prepare.chat_template import ChatTemplate

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "all")
# What --max-bad-fraction counts, beyond the formats' own kinds (records.BAD; a content that
# is not a string is their `not_text`).
BAD = ("no_messages", "unknown_role", "no_assistant", "too_long", "template_error",
       "no_reply", "same_replies")  # the last two: preference records (preference.py)


@dataclasses.dataclass(frozen=True)
class ChatSpec:
    """How chat records are made into tokens (carried to the worker processes)."""

    template: ChatTemplate
    train_on: str = "assistant"
    max_length: int | None = None  # tokens; longer conversations are skipped
    # prepare --preference: records are preference pairs (preference.py), each two documents
    preference: bool = False

    def identity(self) -> dict:
        identity = {"template_sha256": self.template.sha256, "train_on": self.train_on,
                    "max_length": self.max_length}
        if self.preference:  # absent otherwise: chat plans made before stay valid
            identity["preference"] = True
            identity["mask"] = "after_prompt"  # TRL's completions (preference.py)
        elif self.train_on == "assistant" and self.template.has_generation:
            identity["mask"] = "generation"
        return identity


class BadRecord(Exception):
    """A record that cannot be trained on; `kind` is its report entry."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


def conversation(record) -> list[dict]:
    """The record's messages, checked; BadRecord otherwise."""
    if not isinstance(record, dict):
        raise BadRecord("no_messages")
    if record.get("messages") is None and "prompt" in record and "completion" in record:
        turns = [("user", record["prompt"]), ("assistant", record["completion"])]
        if not all(isinstance(text, str) for _, text in turns):
            raise BadRecord("not_text")
        return [{"role": role, "content": text} for role, text in turns]
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRecord("no_messages")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRecord("unknown_role")
        if not isinstance(message.get("content"), str):
            raise BadRecord("not_text")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def assistant_spans(messages: list[dict], template: ChatTemplate, text: str) -> list[tuple]:
    """[start, end) in characters of `text` (the whole rendering) of each assistant turn
    (module docstring); BadRecord("template_error") when the template does not render the
    conversation as a growing prefix (a template that rewrites earlier turns)."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:k], add_generation_prompt=True)
        through = template.render(messages[:k + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise BadRecord("template_error")
        spans.append((len(before), len(through.rstrip())))
    return spans


def encode(record, spec: ChatSpec, tokenizer) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids, mask uint8, UTF-8 bytes of the rendered text) of one record; BadRecord."""
    messages = conversation(record)
    if spec.train_on == "assistant" and not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant")
    try:
        text, spans = rendered(messages, spec)
    except jinja2.TemplateError:  # raise_exception in the template, or a render error
        raise BadRecord("template_error") from None
    ids, starts, ends = tokenizer.encode_rendered(text)
    if spec.max_length is not None and len(ids) > spec.max_length:
        raise BadRecord("too_long")
    if spec.train_on == "all":
        return ids, np.ones(len(ids), np.uint8), len(text.encode("utf-8"))
    mask = span_mask(starts, ends, spans)
    if not mask.any():  # generation blocks that mark nothing of this conversation
        raise BadRecord("no_assistant")
    return ids, mask, len(text.encode("utf-8"))


def rendered(messages: list[dict], spec: ChatSpec) -> tuple[str, list[tuple]]:
    """(the conversation as text, the spans its mask marks: module docstring)."""
    if spec.train_on == "all":
        return spec.template.render(messages), []
    if spec.template.has_generation:
        return spec.template.render_tracked(messages)
    text = spec.template.render(messages)
    return text, assistant_spans(messages, spec.template, text)


def span_mask(starts: np.ndarray, ends: np.ndarray, spans: list[tuple]) -> np.ndarray:
    """uint8 a token: 1 when any of its characters [start, end) lies in one of the spans."""
    ends = np.maximum(ends, starts + 1)  # a token of no characters sits at its start
    mask = np.zeros(len(starts), bool)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
    return mask.astype(np.uint8)
