"""Engine completions in OpenAI's shapes: whole responses, streamed chunks (server-sent
events), log-probabilities as each endpoint gives them, and usage."""

from __future__ import annotations

import json
import time
import uuid


class Replies:
    """The pieces of one request's answer: its id, model, creation time, endpoint."""

    def __init__(self, model: str, chat: bool, token_text):
        self.model, self.chat, self.token_text = model, chat, token_text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, suffix: str = "") -> dict:
        return {"id": self.id, "object": self.object + suffix, "created": self.created,
                "model": self.model}

    def whole(self, completions, prompt_tokens: int, top_logprobs: bool, logprobs: bool
              ) -> dict:
        choices = []
        for c in completions:
            choice = {"index": c.index, "finish_reason": c.finish_reason,
                      "logprobs": self.logprobs(c.ids, c.logprobs, c.top_logprobs)
                      if logprobs else None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text or ""}
            else:
                choice["text"] = c.text or ""
            choices.append(choice)
        made = sum(len(c.ids) for c in completions)
        return {**self._head(), "choices": choices, "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": made,
            "total_tokens": prompt_tokens + made}}

    def chunk(self, index: int, delta: str, finish: str | None, first: bool = False,
              logprobs: dict | None = None) -> str:
        """One server-sent event of a stream."""
        if self.chat:
            piece = {"content": delta}
            if first:
                piece["role"] = "assistant"
            choice = {"index": index, "delta": piece}
        else:
            choice = {"index": index, "text": delta}
        choice.update(finish_reason=finish, logprobs=logprobs)
        return event({**self._head(".chunk" if self.chat else ""), "choices": [choice]})

    def logprobs(self, ids, logprobs, tops, offset: int = 0) -> dict:
        """The chat endpoint's {content: [...]} or the completions endpoint's lists."""
        texts = [self.token_text(i) for i in ids]
        if self.chat:
            return {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": self.token_text(a), "logprob": alp,
                                   "bytes": list(self.token_text(a).encode())}
                                  for a, alp in top]}
                for t, lp, top in zip(texts, logprobs, tops or [[]] * len(ids))]}
        starts = [offset + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
        return {"tokens": texts, "token_logprobs": list(logprobs), "text_offset": starts,
                "top_logprobs": [{self.token_text(a): alp for a, alp in top}
                                 for top in (tops or [[]] * len(ids))]}


def event(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"
