"""OpenAI's request bodies read into engine requests: which fields are taken, their types
and ranges, OpenAI's defaults; a bad one is an ApiError (HTTP status, one-line message
naming the field) that the app answers in OpenAI's error shape."""

from __future__ import annotations

import dataclasses
import secrets

from jaxtrain.engine import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = \
            status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    max_tokens: int  # a request's max_tokens at most
    default_max_tokens: int  # when it gives none (completions; chat fills the context)
    top_n: int  # top_logprobs at most


def _field(body: dict, name: str, kinds, default=None, check=None, valid: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ApiError(400, f"{name}={value!r} is invalid: {valid}", name)
    if not isinstance(value, kinds) or (check is not None and not check(value)):
        raise ApiError(400, f"{name}={value!r} is invalid: {valid}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > 4:
        raise ApiError(400, f"stop={stop!r} is invalid: a string or up to 4 of them", "stop")
    return tuple(stops)


def sampling(body: dict, limits: Limits, chat: bool) -> SamplingParams:
    """The sampling fields of a completions or chat body, OpenAI's defaults where absent
    (temperature 1, top_p 1, n 1; a random seed)."""
    number = (int, float)
    max_tokens = _field(body, "max_completion_tokens" if chat and "max_completion_tokens"
                        in body else "max_tokens", int, None, lambda v: v >= 1,
                        f"an integer in [1, {limits.max_tokens}]")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise ApiError(400, f"max_tokens={max_tokens} is too many: at most "
                       f"{limits.max_tokens}", "max_tokens")
    if chat:
        logprobs = _field(body, "logprobs", bool, False, valid="true or false")
        top = _field(body, "top_logprobs", int, 0, lambda v: 0 <= v <= limits.top_n,
                     f"an integer in [0, {limits.top_n}]")
    else:
        top = _field(body, "logprobs", int, None, lambda v: 0 <= v <= limits.top_n,
                     f"an integer in [0, {limits.top_n}]")
        logprobs, top = top is not None, top or 0
    return SamplingParams(
        max_new_tokens=max_tokens or (None if chat else limits.default_max_tokens),
        temperature=float(_field(body, "temperature", number, 1.0, lambda v: 0 <= v <= 2,
                                 "a number in [0, 2]")),
        top_p=float(_field(body, "top_p", number, 1.0, lambda v: 0 < v <= 1,
                           "a number in (0, 1]")),
        top_k=_field(body, "top_k", int, 0, lambda v: v >= 0, "an integer >= 0"),
        min_p=float(_field(body, "min_p", number, 0.0, lambda v: 0 <= v <= 1,
                           "a number in [0, 1]")),
        seed=_field(body, "seed", int, secrets.randbelow(2 ** 32),
                    lambda v: 0 <= v < 2 ** 32, "an integer in [0, 2**32)"),
        n=_field(body, "n", int, 1, lambda v: 1 <= v <= 128, "an integer in [1, 128]"),
        stop=_stop(body), logprobs=logprobs, top_logprobs=top)


def prompt_of(body: dict, encode) -> list[int]:
    """A completions body's prompt: text (encoded), or token ids; one prompt a request."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "prompt is invalid: a non-empty string or list of token ids "
                   "(one prompt a request)", "prompt")


def messages_of(body: dict) -> list[dict]:
    """A chat body's messages: role and string content each (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages is invalid: a non-empty list of {role, content}",
                       "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            content = "".join(parts) if all(isinstance(p, str) for p in parts) else None
        if not isinstance(content, str) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] is invalid: needs a string role and a text "
                           "content", "messages")
        out.append({"role": m["role"], "content": content})
    return out
