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

Generation: prompts of one length go through the decoder together (it has no padding mask,
so prompts of different lengths cannot share a batch without changing their results); rows
are padded up to the batch size by repeating a prompt, so each prompt length compiles once.
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

from jaxtrain.errors import DataError
from jaxtrain.mesh import batch_shards, constrain, logical_to_spec
from jaxtrain.models.attention import KERNELS
from jaxtrain.models.head_loss import soft_cap
from jaxtrain.sampling import Sampling, make_generate

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
                   -(-batch // multiple) * multiple, seq_multiple, params, progress)

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
                 seed: int = 0) -> list[list[int]]:
        """max_new_tokens tokens continuing each prompt (greedy at temperature 0; else
        sampled as sampling.Sampling says). Each prompt must leave room for them within
        model.seq_len."""
        sampling = Sampling(max_new_tokens, temperature, top_k, top_p)
        sampling.check()
        groups: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            if not prompt or len(prompt) + sampling.max_new_tokens > self.seq_len:
                raise DataError(f"a prompt of {len(prompt)} tokens plus {sampling.max_new_tokens}"
                                f" new ones does not fit model.seq_len={self.seq_len}")
            groups.setdefault(len(prompt), []).append(i)
        chunks = [(group[s:s + self.batch]) for _, group in sorted(groups.items())
                  for s in range(0, len(group), self.batch)]
        results: list = [None] * len(prompts)
        generate = self._generate_fn(sampling)
        for n, chosen in enumerate(tqdm.tqdm(chunks, desc="generating", unit="batch",
                                             leave=False,
                                             disable=not self.progress or len(chunks) < 2)):
            batch = np.asarray([prompts[i] for i in chosen]
                               + [prompts[chosen[0]]] * (self.batch - len(chosen)), np.int32)
            with jax.set_mesh(self.mesh):
                tokens = generate(self.params, self._global(batch),
                                  jax.random.fold_in(jax.random.key(seed), n))
            tokens = np.asarray(jax.device_get(tokens))
            for slot, i in enumerate(chosen):
                results[i] = tokens[slot].tolist()
        return results

    def _generate_fn(self, sampling: Sampling):
        if sampling not in self.compiled:
            self.compiled[sampling] = jax.jit(
                make_generate(self.graphdef, sampling, self.rules),
                out_shardings=NamedSharding(self.mesh, P()))
        return self.compiled[sampling]


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
