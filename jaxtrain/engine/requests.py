"""What the engine is asked for and what it answers: a request (prompt ids and its
sampling), a completion per sample, and the one-line checks of a request's values."""

from __future__ import annotations

import dataclasses

from jaxtrain.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int | None = None  # None: up to the engine's max_len
    temperature: float = 0.0  # 0: greedy (argmax), deterministic
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int = 0
    n: int = 1  # samples of the prompt, sharing its prefill
    stop: tuple[str, ...] = ()  # stop strings, checked on the decoded text
    logprobs: bool = False  # each sampled token's log-probability
    top_logprobs: int = 0  # and this many likeliest alternatives (<= the engine's top_n)
    ignore_eos: bool = False  # go on past an EOS id (fixed-length generation)

    def check(self, top_n: int = 0) -> None:
        """ConfigError, one line naming the key and what is valid."""
        for name, ok, valid in (
                ("max_new_tokens", self.max_new_tokens is None or self.max_new_tokens >= 1,
                 ">= 1"),
                ("temperature", self.temperature >= 0, ">= 0 (0: greedy)"),
                ("top_k", self.top_k >= 0, ">= 0 (0: off)"),
                ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1: off)"),
                ("min_p", 0 <= self.min_p <= 1, "in [0, 1] (0: off)"),
                ("seed", 0 <= self.seed < 2 ** 32, "in [0, 2**32)"),
                ("n", self.n >= 1, ">= 1"),
                ("top_logprobs", 0 <= self.top_logprobs <= top_n, f"in [0, {top_n}]"),
                ("stop", all(isinstance(s, str) and s for s in self.stop),
                 "non-empty strings")):
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} is invalid: must be {valid}")


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()


@dataclasses.dataclass
class Completion:
    """One sample of a request. ids: the new tokens, an EOS id that ended it included;
    text: their decoded text (None without a tokenizer), without the EOS token and cut
    before a stop string; finish_reason: "stop" (an EOS id or a stop string) or "length"
    (max_new_tokens, or the engine's max_len)."""

    index: int
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # Per token, the top_logprobs likeliest (id, log-probability) pairs.
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None


def check_prompt(prompt_ids, vocab_size: int, max_len: int, max_new_tokens: int | None
                 ) -> int:
    """The new tokens a prompt gets (max_new_tokens, or what max_len leaves); ConfigError
    for a prompt the engine cannot take."""
    bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if not prompt_ids or bad:
        raise ConfigError(f"prompt: must be 1 or more token ids in [0, {vocab_size}); "
                          f"got {bad[:5] or 'none'}")
    room = max_len - len(prompt_ids)
    if room < 1:
        raise ConfigError(f"prompt: {len(prompt_ids)} tokens leave no room for new ones "
                          f"within the context of {max_len} tokens")
    if max_new_tokens is not None and max_new_tokens > room:
        raise ConfigError(f"max_new_tokens={max_new_tokens} is too many: the prompt "
                          f"({len(prompt_ids)} tokens) plus new tokens must fit the context "
                          f"of {max_len}; at most {room}")
    return room if max_new_tokens is None else max_new_tokens
