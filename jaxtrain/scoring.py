"""Scoring token sequences with a model's parameters, batched, on whatever mesh the
parameters live on: the log-likelihood of continuations given contexts, and continuations
decoded with the KV cache. This is what downstream-task evaluation (jaxtrain/tasks/) asks of
a model, both from a checkpoint (`jaxtrain eval --tasks`) and on the training parameters in
the loop (train/task_eval.py).

Log-likelihoods: each (context, continuation) becomes one row, right-padded; rows are sorted
by length and batched, and each batch is padded to a length bucket (powers of two, at least
16, at most model.seq_len), so a task compiles a handful of shapes however varied its items.
A causal model's logits at a position do not depend on what comes after it, so padding
changes nothing the score reads. The head runs over sequence chunks, so the B·L·V logits
never exist at once (a 128k vocabulary would otherwise need gigabytes per batch).

Generation runs on the engine (jaxtrain/engine/): prompts of any lengths share its `batch`
slots, each row at its own position, each ending at its stop strings or EOS.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.engine import Engine, Model, Request, SamplingParams
from jaxtrain.errors import DataError, JaxtrainError
from jaxtrain.mesh import batch_shards, constrain, logical_to_spec
from jaxtrain.models.attention import KERNELS
from jaxtrain.models.head_loss import soft_cap

MIN_BUCKET = 16
HEAD_CHUNK_TOKENS = 2048  # rows × positions whose logits exist at once


@dataclasses.dataclass
class Scorer:
    """A model's graph on a mesh, and the parameters it scores with (`bind` swaps them, so
    the loop scores its current parameters without a copy, reusing the compiled shapes)."""

    graphdef: nnx.GraphDef
    mesh: jax.sharding.Mesh
    rules: tuple
    seq_len: int
    batch: int  # rows per batch: a multiple of the ways the batch is split
    seq_multiple: int = 1  # what every padded length must divide by
    params: dict | None = None
    progress: bool = True
    vocab_size: int = 1 << 30  # ids at most (prompts are checked against it)
    compiled: dict = dataclasses.field(default_factory=dict, repr=False)  # by what it does

    @classmethod
    def from_setup(cls, setup, batch: int, params: dict | None = None,
                   progress: bool = True) -> Scorer:
        """A scorer on a train.setup.Setup's mesh; `batch` is rounded up to what the mesh
        and the pipeline schedule can split."""
        spec, sizes = setup.spec, dict(setup.mesh.shape)
        multiple = batch_shards(sizes) * (spec.pipeline.microbatches if spec.pipeline else 1)
        seq_multiple = KERNELS[spec.attention].seq_multiple
        for name, axes in spec.rules:  # sequence parallelism splits the length too
            if name == "sequence" and axes:
                axes = (axes,) if isinstance(axes, str) else axes
                seq_multiple = math.lcm(seq_multiple, math.prod(sizes[a] for a in axes))
        return cls(setup.graphdef, setup.mesh, spec.rules, spec.seq_len,
                   -(-batch // multiple) * multiple, seq_multiple, params, progress,
                   spec.vocab_size)

    def bind(self, params: dict) -> Scorer:
        self.params = params
        return self

    # --- log-likelihoods --------------------------------------------------------------

    def loglikelihoods(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                       ) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding gives the continuation)
        for each (context ids, continuation ids). A context too long for model.seq_len loses
        its oldest tokens, as the harness's own models do."""
        rows = [self._row(context, continuation) for context, continuation in pairs]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list = [None] * len(rows)
        starts = range(0, len(order), self.batch)
        for start in tqdm.tqdm(starts, desc="scoring", unit="batch", leave=False,
                               disable=not self.progress or len(starts) < 2):
            chosen = order[start:start + self.batch]
            logprob, greedy = self._score_batch([rows[i] for i in chosen])
            for slot, i in enumerate(chosen):
                results[i] = (float(logprob[slot]), bool(greedy[slot]))
        return results

    def _row(self, context, continuation) -> tuple[list[int], int]:
        """(input ids, how many of the last targets are the continuation's)."""
        if not continuation:
            raise DataError("a request has an empty continuation: nothing to score")
        if len(continuation) > self.seq_len:
            raise DataError(f"a continuation of {len(continuation)} tokens is longer than "
                            f"the model's model.seq_len={self.seq_len}")
        whole = (list(context) + list(continuation))[-(self.seq_len + 1):]
        return whole, len(continuation)

    def bucket(self, length: int) -> int:
        """The padded length of a batch whose longest input has `length` tokens."""
        padded = max(MIN_BUCKET, 1 << (length - 1).bit_length())
        padded = -(-padded // self.seq_multiple) * self.seq_multiple
        return min(padded, self.seq_len)

    def _score_batch(self, rows) -> tuple[np.ndarray, np.ndarray]:
        length = self.bucket(max(len(whole) - 1 for whole, _ in rows))
        inputs = np.zeros((self.batch, length), np.int32)
        targets = np.zeros((self.batch, length), np.int32)
        mask = np.zeros((self.batch, length), np.float32)
        for r, (whole, scored) in enumerate(rows):
            n = len(whole) - 1
            inputs[r, :n], targets[r, :n] = whole[:-1], whole[1:]
            mask[r, n - scored:n] = 1.0
        with jax.set_mesh(self.mesh):
            out = self._score_fn()(self.params, *map(self._global, (inputs, targets, mask)))
        return jax.device_get(out)

    def _score_fn(self):
        if "score" not in self.compiled:
            replicated = NamedSharding(self.mesh, P())
            self.compiled["score"] = jax.jit(
                functools.partial(_token_scores, self.graphdef, self.rules),
                out_shardings=(replicated, replicated))
        return self.compiled["score"]

    def _global(self, host: np.ndarray) -> jax.Array:
        """A batch every process holds whole, as a global array split by rows."""
        sharding = NamedSharding(self.mesh, logical_to_spec(("batch", None), self.rules))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    # --- generation -------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, stop: Sequence[str] = (), tokenizer=None,
                 eos_ids: Sequence[int] = ()) -> list[list[int]]:
        """Up to max_new_tokens tokens continuing each prompt, on the generation engine
        (jaxtrain/engine/: `batch` slots, continuous batching; greedy at temperature 0).
        A continuation ends early at an EOS id (kept, last) or at a stop string (its text:
        needs `tokenizer`). Each prompt must leave room for them within model.seq_len."""
        for prompt in prompts:
            if not prompt or len(prompt) + max_new_tokens > self.seq_len:
                raise DataError(f"a prompt of {len(prompt)} tokens plus {max_new_tokens}"
                                f" new ones does not fit model.seq_len={self.seq_len}")
        engine = self._engine()
        engine.eos_ids, engine.tokenizer = frozenset(eos_ids), tokenizer
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, stop=tuple(stop))
        try:
            results = engine.generate([Request(tuple(p), params) for p in prompts])
        except JaxtrainError as e:
            raise DataError(f"generation: {e}") from None
        return [completions[0].ids for completions in results]

    def _engine(self) -> Engine:
        """The engine (compiled once), on the scorer's current parameters."""
        model = Model(self.graphdef, self.params, self.mesh, self.rules, self.vocab_size,
                      self.seq_len)
        if "engine" not in self.compiled:
            self.compiled["engine"] = Engine(model, slots=self.batch)
        self.compiled["engine"].model = model
        return self.compiled["engine"]


def _token_scores(graphdef, rules, params, inputs_BL, targets_BL, mask_BL):
    """Per row: the summed log-probability of the masked targets, and whether each masked
    target is the argmax of its logits."""
    model = nnx.merge(graphdef, params)
    x_BLD = model.features(inputs_BL)
    head, vocab_major = model.head_as_stored()
    b, length, d = x_BLD.shape
    chunk = max(c for c in range(1, length + 1)
                if length % c == 0 and c * b <= max(HEAD_CHUNK_TOKENS, b))

    def scores(x_BCD, targets_BC):
        logits_BCV = (x_BCD @ (head.T if vocab_major else head)).astype(jnp.float32)
        logits_BCV = soft_cap(constrain(logits_BCV, ("batch", "length", "vocab"), rules),
                              model.spec.final_softcap)
        picked_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
        logprob_BC = picked_BC - jax.nn.logsumexp(logits_BCV, axis=-1)
        return logprob_BC, jnp.argmax(logits_BCV, axis=-1) == targets_BC

    split = lambda a: jnp.swapaxes(a.reshape(b, length // chunk, chunk, *a.shape[2:]), 0, 1)  # noqa: E731
    logprob_NBC, greedy_NBC = jax.lax.map(lambda xs: scores(*xs),
                                          (split(x_BLD), split(targets_BL)))
    mask_NBC = split(mask_BL)
    logprob_B = (logprob_NBC * mask_NBC).sum(axis=(0, 2))
    greedy_B = jnp.all(greedy_NBC | (mask_NBC == 0), axis=(0, 2))
    return logprob_B, greedy_B
