"""Preference records -> pairs of documents (`prepare --preference`, for DPO).

A record is `{"prompt": str, "chosen": str, "rejected": str}` (the prompt one user turn), or
`{"messages": [...], "chosen": ..., "rejected": ...}` (the conversation up to the reply,
roles as for --chat); a reply is a string, an assistant message `{"role": "assistant",
"content": str}`, or a list holding one (TRL's conversational form). Each reply is rendered
after the conversation with the chat template, as --chat renders a conversation
(chat.py), and its mask marks the reply alone: the characters the template adds for that
last assistant turn (its content and end-of-turn token), not earlier assistant turns of
the prompt, which both documents share.

Pair k is documents 2k (chosen) and 2k + 1 (rejected): one record, so shards, parts and
merges never separate them. A bad record (counted with file:line, never fatal): no prompt
or messages (`no_messages`), a missing, empty or non-assistant reply (`no_reply`,
`unknown_role`), a role not in chat.ROLES, a pair whose two documents together exceed
--max-length (`too_long`: they share one row), a template that refuses it.
"""

from __future__ import annotations

import jinja2
import numpy as np

from jaxtrain.prepare import chat
from jaxtrain.prepare.chat import BadRecord


def prompt_messages(record) -> list[dict]:
    """The conversation before the replies, checked; BadRecord otherwise."""
    if not isinstance(record, dict):
        raise BadRecord("no_messages")
    if record.get("messages") is None and "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise BadRecord("not_text")
        if not prompt:
            raise BadRecord("no_messages")
        return [{"role": "user", "content": prompt}]
    return chat.conversation({"messages": record.get("messages")})


def reply(value) -> str:
    """A reply's text: a non-empty string, or an assistant message (alone in a list, as
    TRL writes them); BadRecord otherwise."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        if value.get("role", "assistant") != "assistant":
            raise BadRecord("unknown_role")
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise BadRecord("no_reply")
    return value


def encode_pair(record, spec: chat.ChatSpec, tokenizer
                ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """([(ids, mask) chosen, (ids, mask) rejected], UTF-8 bytes of both renderings) of
    one record; BadRecord."""
    messages = prompt_messages(record)
    replies = [reply(record.get(key)) for key in ("chosen", "rejected")]
    documents, text_bytes = [], 0
    for text_reply in replies:
        conversation = messages + [{"role": "assistant", "content": text_reply}]
        try:
            text = spec.template.render(conversation)
            spans = chat.assistant_spans(conversation, spec.template, text)[-1:]
        except jinja2.TemplateError:
            raise BadRecord("template_error") from None
        ids, starts, ends = tokenizer.encode_rendered(text)
        documents.append((ids, chat.span_mask(starts, ends, spans)))
        text_bytes += len(text.encode("utf-8"))
    if spec.max_length is not None and sum(len(ids) for ids, _ in documents) > spec.max_length:
        raise BadRecord("too_long")
    return documents, text_bytes
