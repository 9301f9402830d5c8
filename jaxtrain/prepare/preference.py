"""Preference records -> pairs of documents (`prepare --preference`, for DPO).

A record is `{"prompt": str, "chosen": str, "rejected": str}` (the prompt one user turn), or
`{"messages": [...], "chosen": ..., "rejected": ...}` (the conversation up to the reply,
roles as for --chat); a reply is a string, an assistant message `{"role": "assistant",
"content": str}`, or a list holding one (TRL's conversational form). Each reply is rendered
after the conversation with the chat template, as --chat renders a conversation
(chat.py), and its mask marks the completion as TRL's DPOTrainer takes it: every token after
the prompt rendered with its generation prompt (`render(messages,
add_generation_prompt=True)`), to the end of the rendering. For ChatML that is the reply,
`<|im_end|>` and the newline after it; for Llama 3 the reply and `<|eot_id|>`. Earlier
assistant turns of the prompt, which both documents share, are not marked, and
`{% generation %}` blocks do not change it (TRL's DPO does not read them either).

Pair k is documents 2k (chosen) and 2k + 1 (rejected): one record, so shards, parts and
merges never separate them. A bad record (counted with file:line, never fatal): no prompt
or messages (`no_messages`), a missing, empty or non-assistant reply (`no_reply`,
`unknown_role`), a chosen reply equal to the rejected one (`same_replies`: its DPO loss is
log 2 whatever the model, and its gradient 0), a role not in chat.ROLES, a pair whose two
documents together exceed --max-length (`too_long`: they share one row), a template that
refuses it (or does not render the prompt as a prefix of the conversation:
`template_error`, where TRL would cut the completion where the tokens diverge).
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
    if replies[0] == replies[1]:
        raise BadRecord("same_replies")
    documents, text_bytes = [], 0
    try:
        prompt = spec.template.render(messages, add_generation_prompt=True)
        texts = [spec.template.render(messages + [{"role": "assistant", "content": text}])
                 for text in replies]
    except jinja2.TemplateError:
        raise BadRecord("template_error") from None
    for text in texts:
        if not text.startswith(prompt):
            raise BadRecord("template_error")
        ids, starts, ends = tokenizer.encode_rendered(text)
        documents.append((ids, chat.span_mask(starts, ends, [(len(prompt), len(text))])))
        text_bytes += len(text.encode("utf-8"))
    if spec.max_length is not None and sum(len(ids) for ids, _ in documents) > spec.max_length:
        raise BadRecord("too_long")
    return documents, text_bytes
