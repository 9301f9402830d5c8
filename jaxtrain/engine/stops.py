"""Where a sample ends, checked in Python between decode steps: at an EOS id, at a stop
string in its decoded text, or at its token budget; and the text a stream may already
show (none that a stop string might still take back)."""

from __future__ import annotations

import dataclasses

# A decoder shows an incomplete UTF-8 sequence as U+FFFD; a stream waits for the rest.
_INCOMPLETE = "\ufffd"


@dataclasses.dataclass
class Stopper:
    """One sample's end conditions and its text so far."""

    eos_ids: frozenset
    stops: tuple[str, ...]
    budget: int  # new tokens at most
    tokenizer: object = None
    streaming: bool = False  # the text is wanted after every token, not only at the end
    text: str = ""
    shown: int = 0  # characters a stream has been given

    def add(self, ids: list[int]) -> str | None:
        """The finish reason after `ids` (every new token so far, the newest last), or
        None to go on; the text is brought up to date (cut before a stop string) at the
        end, and after every token where stop strings or a stream need it."""
        if ids[-1] in self.eos_ids:
            self._decode(ids[:-1])
            return "stop"
        last = len(ids) >= self.budget
        if self.stops or self.streaming or last:  # else no decode per token: O(n) not O(n²)
            self._decode(ids)
        if self.stops:
            ends = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
            if ends:
                self.text = self.text[:min(ends)]
                return "stop"
        return "length" if last else None

    def _decode(self, ids: list[int]) -> None:
        if self.tokenizer is not None:
            self.text = self.tokenizer.decode(ids)

    def delta(self, final: bool) -> str:
        """Text not yet shown that no stop string can still remove (all of it at the end)."""
        end = len(self.text)
        if not final:
            end -= max((len(s) for s in self.stops), default=1) - 1
            while end > self.shown and self.text[end - 1:end] == _INCOMPLETE:
                end -= 1
        if end <= self.shown:
            return ""
        out, self.shown = self.text[self.shown:end], end
        return out
