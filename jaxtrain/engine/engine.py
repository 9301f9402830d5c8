"""Continuous batching: a fixed number of slots in one KV cache; a request waits until
its n samples each find a free slot, is prefilled once and inserted into all of them; then
every step decodes one token of every busy slot, and between steps (in Python) a sample
that ended frees its slot for the next waiting request.

A slot's prefill holds its prompt but the last token; the first step feeds that token at
its position, so the first new token comes from the decode step like every later one.
Rows never see each other (each attends to its own slot's cache, up to its own position),
so a request's greedy tokens do not depend on what shares the batch with it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain.engine.requests import Completion, Request, check_prompt
from jaxtrain.engine.sampler import RowSampling
from jaxtrain.engine.steps import Model, Steps, bucket, key_bucket
from jaxtrain.engine.stops import Stopper
from jaxtrain.errors import ConfigError

# listener(completion, text delta, finished): called after each new token of a sample
Listener = Callable[[Completion, str, bool], None]


@dataclasses.dataclass
class _Sample:
    request: Request
    completion: Completion
    stopper: Stopper
    listener: Listener | None


def _to_host(arrays) -> list:
    """The step's outputs on the host; on a mesh that spans processes (a GRPO job of
    several, every process sampling the same requests) gathered from all of them."""
    if all(a.is_fully_addressable for a in arrays):
        return jax.device_get(arrays)
    return multihost_utils.process_allgather(arrays, tiled=True)


class Engine:
    """engine.generate(requests) -> each request's completions; or submit() requests and
    call step() (one decode step, admitting waiting requests first) from one thread."""

    def __init__(self, model: Model, *, slots: int = 8, max_len: int | None = None,
                 eos_ids: Sequence[int] = (), tokenizer=None, top_n: int = 0):
        self.model, self.slots = model, slots
        self.max_len = min(max_len or model.seq_len, model.seq_len)
        self.eos_ids, self.tokenizer, self.top_n = frozenset(eos_ids), tokenizer, top_n
        self.steps = Steps(model, slots, self.max_len, top_n)
        self.waiting: collections.deque = collections.deque()
        self.busy: list[_Sample | None] = [None] * slots
        self.tokens_S = np.zeros(slots, np.int32)
        self.positions_S = np.zeros(slots, np.int32)
        self.rows = {k: np.zeros(slots, t) for k, t in (
            ("temperature_S", np.float32), ("top_k_S", np.int32), ("top_p_S", np.float32),
            ("min_p_S", np.float32), ("seed_S", np.uint32), ("sample_S", np.int32),
            ("index_S", np.int32))}
        with self._mesh():
            self.cache = self.steps.init_cache(model.params)

    def _mesh(self):
        """The model's mesh, set; a Model without one runs under the caller's."""
        if self.model.mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.model.mesh)

    def check(self, request: Request) -> int:
        """The new-token budget of each of the request's samples; ConfigError (one line)
        for one the engine cannot serve."""
        p = request.params
        p.check(self.top_n)
        if p.n > self.slots:
            raise ConfigError(f"n={p.n} is too many: this engine has {self.slots} slots")
        if p.stop and self.tokenizer is None:
            raise ConfigError("stop: stop strings need the model's tokenizer, and it has none")
        return check_prompt(list(request.prompt_ids), self.model.vocab_size, self.max_len,
                            p.max_new_tokens)

    def submit(self, request: Request, listener: Listener | None = None) -> list[Completion]:
        """Queues a request; its completions fill in as it runs (listener: told of each
        token)."""
        budget = self.check(request)
        samples = [_Sample(request, Completion(i), Stopper(
            frozenset() if request.params.ignore_eos else self.eos_ids, request.params.stop,
            budget, self.tokenizer, streaming=listener is not None), listener)
            for i in range(request.params.n)]
        self.waiting.append(samples)
        return [s.completion for s in samples]

    def cancel(self, listener: Listener) -> None:
        """Drops the samples of the request heard by `listener`, waiting or decoding."""
        self.waiting = collections.deque(s for s in self.waiting if s[0].listener is not listener)
        for slot, sample in enumerate(self.busy):
            if sample is not None and sample.listener is listener:
                self.busy[slot] = None

    def drop_all(self) -> set:
        """Drops every request (after a failed step); returns their listeners."""
        listeners = {s.listener for s in self.busy if s is not None}
        listeners |= {samples[0].listener for samples in self.waiting}
        self.waiting.clear()
        self.busy = [None] * self.slots
        with self._mesh():  # the failed step may have taken the donated cache
            self.cache = self.steps.init_cache(self.model.params)
        return listeners - {None}

    def idle(self) -> bool:
        return not self.waiting and not any(self.busy)

    def generate(self, requests: Sequence[Request]) -> list[list[Completion]]:
        out = [self.submit(r) for r in requests]
        while not self.idle():
            self.step()
        return out

    def step(self) -> None:
        """Admits what fits, then decodes one token of every busy slot."""
        with self._mesh():
            self._admit()
            if not any(self.busy):
                return
            rows = RowSampling(**self.rows)
            need = 1 + max(int(self.positions_S[s]) for s, b in enumerate(self.busy) if b)
            self.cache, *out = self.steps.step(self.model.params, self.cache, self.tokens_S,
                                               self.positions_S, rows,
                                               keys=key_bucket(need, self.max_len))
        tokens_S, logprobs_S, top_ids_SN, top_lp_SN = _to_host(out)
        for slot, sample in enumerate(self.busy):
            if sample is not None:
                self._advance(slot, sample, int(tokens_S[slot]), float(logprobs_S[slot]),
                              top_ids_SN[slot], top_lp_SN[slot])

    def _admit(self) -> None:
        while self.waiting:
            free = [s for s, busy in enumerate(self.busy) if busy is None]
            samples = self.waiting[0]
            if len(free) < len(samples):
                return
            self.waiting.popleft()
            prompt = list(samples[0].request.prompt_ids)
            piece = None
            if len(prompt) > 1:  # all but the last token; the step feeds that one
                padded = np.zeros((1, bucket(len(prompt) - 1, self.max_len)), np.int32)
                padded[0, :len(prompt) - 1] = prompt[:-1]
                piece = self.steps.prefill(self.model.params, padded,
                                           np.int32(len(prompt) - 1))
            for slot, sample in zip(free, samples):
                if piece is not None:
                    self.cache = self.steps.insert(self.cache, piece, np.int32(slot))
                self._seat(slot, sample, prompt)

    def _seat(self, slot: int, sample: _Sample, prompt: list[int]) -> None:
        p = sample.request.params
        self.busy[slot] = sample
        self.tokens_S[slot], self.positions_S[slot] = prompt[-1], len(prompt) - 1
        for key, value in (("temperature_S", p.temperature), ("top_k_S", p.top_k),
                           ("top_p_S", p.top_p), ("min_p_S", p.min_p), ("seed_S", p.seed),
                           ("sample_S", sample.completion.index), ("index_S", 0)):
            self.rows[key][slot] = value

    def _advance(self, slot: int, sample: _Sample, token: int, logprob: float,
                 top_ids_N, top_lp_N) -> None:
        c, p = sample.completion, sample.request.params
        c.ids.append(token)
        if p.logprobs or p.top_logprobs:
            c.logprobs.append(logprob)
        if p.top_logprobs:
            c.top_logprobs.append([(int(i), float(v)) for i, v in
                                   zip(top_ids_N[:p.top_logprobs], top_lp_N[:p.top_logprobs])])
        finish = sample.stopper.add(c.ids)
        c.text = sample.stopper.text if self.tokenizer is not None else None
        if finish is not None:
            c.finish_reason = finish
            self.busy[slot] = None
        else:
            self.tokens_S[slot] = token
            self.positions_S[slot] += 1
            self.rows["index_S"][slot] += 1
        if sample.listener is not None:
            sample.listener(c, sample.stopper.delta(finish is not None), finish is not None)
