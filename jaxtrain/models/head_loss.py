"""Output head fused with softmax cross entropy, over sequence chunks.

The plain form materialises B·L·V float32 logits (0.5 GB for 8×512×32000), keeps them for
the backward pass and builds another tensor of that size for their gradient, all in fresh
memory each step. Here the head runs over chunks of the sequence inside a scan, and since
the mean loss is the last op of the step, each chunk's logit gradient (softmax − one-hot)/N is
formed right away and pushed through the head's two backward matmuls: no logits outlive
their chunk and the head costs exactly its three counted matmuls. The incoming cotangent (1
under value_and_grad) only rescales the saved gradients.

With `weights_BL` (packed documents: which targets count, docs/data.md) the loss is the mean
over the counted targets only; the others (padding, and the first token of each document,
which has no context) add nothing to the loss or to any gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxtrain.mesh import constrain, logical_to_spec

# Tokens (rows × positions) whose logits one chunk of the fused head and loss forms: about
# 128 MB of float32 logits at a 32k vocabulary.
CHUNK_TOKENS = 1024


def logits_chunk(length: int, batch: int, shards: int = 1) -> int:
    """Positions per row of one chunk of `batch` rows of `length`, the sequence sharded
    `shards` ways (context parallelism: strided chunks `shards` times longer, so that each
    device's share is the unsharded chunk's). The planner's memory model reads it through
    the objective (objectives.py Objective.logits_chunk)."""
    return chunk_size(length, batch, CHUNK_TOKENS * shards)


def chunk_size(length: int, batch: int, target_tokens: int = CHUNK_TOKENS) -> int:
    """Largest divisor of length with chunk·batch <= target_tokens (logits chunk ~128 MB).
    The planner's memory model counts the same chunk."""
    best = 1
    for c in range(1, length + 1):
        if length % c == 0 and c * batch <= target_tokens:
            best = c
    return best


def _split(x_BL, chunk: int, strided: bool = False):
    """[B, L, ...] -> [L/chunk, B, chunk, ...], the scan axis first; batch stays sharded.
    strided: chunk j holds positions j, j + L/chunk, ... instead of a contiguous run, so
    that a sequence sharded in contiguous blocks (context parallelism) gives every device
    its own share of every chunk: the scan then slices no sharded axis (a contiguous chunk
    would live on one device and be all-gathered, with its logits, at every step)."""
    b, length = x_BL.shape[:2]
    if strided:
        return jnp.moveaxis(x_BL.reshape(b, chunk, length // chunk, *x_BL.shape[2:]), 2, 0)
    return jnp.swapaxes(x_BL.reshape(b, length // chunk, chunk, *x_BL.shape[2:]), 0, 1)


def _unsplit(x_CBc, strided: bool):
    """_split's inverse: [L/chunk, B, chunk, ...] -> [B, L, ...]."""
    n, b, chunk = x_CBc.shape[:3]
    x = jnp.moveaxis(x_CBc, 0, 2) if strided else jnp.swapaxes(x_CBc, 0, 1)
    return x.reshape(b, n * chunk, *x_CBc.shape[3:])


def length_shards(rules) -> int:
    """Devices the `length` axis of activations is split over (context parallelism), in
    the current mesh; 1 outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    entry = logical_to_spec(("batch", "length"), rules)[1]
    if mesh.empty or entry is None:
        return 1
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry))


def soft_cap(logits, cap: float):
    """The final-logit soft-cap part: cap·tanh(logits/cap) (HF's final_logit_softcapping);
    cap 0: the logits as they are."""
    return cap * jnp.tanh(logits / cap) if cap else logits


def _head_axes(vocab_major: bool) -> str:
    """The head's [D, V] or [V, D] axes: a tied head is the [V, D] embedding table itself,
    read in place (a transposed copy of it costs ≈3% of configs/bench_cpu.py's step)."""
    return "vd" if vocab_major else "dv"


def _chunk_loss(x_BCD, head, targets_BC, weights_BC, rules, with_grads: bool,
                vocab_major: bool, cap: float = 0.0):
    head_axes = _head_axes(vocab_major)
    logits_BCV = jnp.einsum(f"bcd,{head_axes}->bcv", x_BCD, head).astype(jnp.float32)
    logits_BCV = constrain(logits_BCV, ("batch", "length", "vocab"), rules)
    if cap:
        tanh_BCV = jnp.tanh(logits_BCV / cap)
        logits_BCV = cap * tanh_BCV
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
    loss_BC = lse_BC - target_BC
    if weights_BC is not None:  # a select, not a product: nothing uncounted can leak in
        loss_BC = jnp.where(weights_BC, loss_BC, 0.0)
    loss = loss_BC.sum()
    if not with_grads:
        return loss, None
    onehot_BCV = jnp.arange(logits_BCV.shape[-1]) == targets_BC[..., None]
    dlogits_BCV = jnp.exp(logits_BCV - lse_BC[..., None]) - onehot_BCV
    if weights_BC is not None:
        dlogits_BCV = jnp.where(weights_BC[..., None], dlogits_BCV, 0.0)
    if cap:  # through cap·tanh(l/cap): times 1 − tanh²
        dlogits_BCV = dlogits_BCV * (1 - tanh_BCV * tanh_BCV)
    return loss, dlogits_BCV.astype(x_BCD.dtype)


def _run(x_BLD, head, targets_BL, weights_BL, rules, with_grads: bool, vocab_major: bool,
         cap: float = 0.0):
    """(summed loss, dx unscaled, dhead unscaled); the grads are None without with_grads."""
    head_axes = _head_axes(vocab_major)
    # Sequence-sharded: strided chunks, each `shards` times longer so that every device's
    # share of a chunk is the unsharded chunk's size.
    shards = length_shards(rules)
    strided = shards > 1
    chunk = logits_chunk(x_BLD.shape[1], x_BLD.shape[0], shards)
    xs = tuple(None if a is None else _split(a, chunk, strided)
               for a in (x_BLD, targets_BL, weights_BL))

    def body(carry, xs_chunk):
        loss, dhead_DV = carry
        x_BCD, targets_BC, weights_BC = xs_chunk
        chunk_loss, dlogits_BCV = _chunk_loss(x_BCD, head, targets_BC, weights_BC, rules,
                                              with_grads, vocab_major, cap)
        if not with_grads:
            return (loss + chunk_loss, dhead_DV), None
        dx_BCD = jnp.einsum(f"bcv,{head_axes}->bcd", dlogits_BCV, head)
        # Accumulated as [D, V] either way: x·dlogits contracted over tokens runs as a plain
        # matmul in that orientation; a vocab-major head takes one transpose at the end.
        dhead_DV = dhead_DV + jnp.einsum("bcd,bcv->dv", x_BCD, dlogits_BCV)
        return (loss + chunk_loss, dhead_DV), dx_BCD

    d, v = x_BLD.shape[-1], head.shape[0 if vocab_major else 1]
    dhead0 = jnp.zeros((d, v), head.dtype) if with_grads else None
    (loss, dhead_DV), dx_CBcD = jax.lax.scan(body, (jnp.zeros((), jnp.float32), dhead0), xs)
    if not with_grads:
        return loss, None, None
    dx_BLD = _unsplit(dx_CBcD, strided)
    return loss, dx_BLD, dhead_DV.T if vocab_major else dhead_DV


def _count(targets_BL, weights_BL):
    """What the summed loss is divided by: every target, or the counted ones (at least 1)."""
    if weights_BL is None:
        return targets_BL.size
    return jnp.maximum(weights_BL.sum(dtype=jnp.float32), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _mean_loss(x_BLD, head, targets_BL, weights_BL, rules, vocab_major, cap):
    loss = _run(x_BLD, head, targets_BL, weights_BL, rules, False, vocab_major, cap)[0]
    return loss / _count(targets_BL, weights_BL)


def _mean_loss_fwd(x_BLD, head, targets_BL, weights_BL, rules, vocab_major, cap):
    loss, dx_BLD, dhead = _run(x_BLD, head, targets_BL, weights_BL, rules, True, vocab_major,
                               cap)
    count = _count(targets_BL, weights_BL)
    return loss / count, (dx_BLD, dhead, None if weights_BL is None else count)


def _mean_loss_bwd(rules, vocab_major, cap, residuals, g):
    dx_BLD, dhead, count = residuals
    scale = g / (dx_BLD.shape[0] * dx_BLD.shape[1] if count is None else count)
    return (dx_BLD * scale.astype(dx_BLD.dtype), dhead * scale.astype(dhead.dtype), None,
            None)


_mean_loss.defvjp(_mean_loss_fwd, _mean_loss_bwd)


def head_cross_entropy(x_BLD: jax.Array, head: jax.Array, targets_BL: jax.Array,
                       rules=(), vocab_major: bool = False, weights_BL=None,
                       cap: float = 0.0) -> jax.Array:
    """mean(softmax_cross_entropy(x @ head, targets)) without materialising all logits.
    head: [D, V], or [V, D] with vocab_major (a tied embedding table). weights_BL (bool):
    which targets count; the mean is over those (None: all). cap: the final-logit
    soft-cap (soft_cap; 0: none)."""
    return _mean_loss(x_BLD, head, targets_BL, weights_BL, rules, vocab_major, cap)


def token_logprobs(x_BLD: jax.Array, head: jax.Array, targets_BL: jax.Array, rules=(),
                   vocab_major: bool = False, cap: float = 0.0) -> jax.Array:
    """[B, L] float32: log softmax(x @ head)[target] of every position, over the same
    sequence chunks as head_cross_entropy, so that no more than a chunk's logits exist at
    once; differentiable (each chunk's logits are recomputed in the backward pass rather
    than kept). For objectives that need each sequence's log-likelihood (DPO), not a mean."""
    head_axes = _head_axes(vocab_major)
    shards = length_shards(rules)
    strided = shards > 1
    chunk = logits_chunk(x_BLD.shape[1], x_BLD.shape[0], shards)

    @jax.checkpoint
    def chunk_logprobs(x_BCD, targets_BC):
        logits_BCV = jnp.einsum(f"bcd,{head_axes}->bcv", x_BCD, head).astype(jnp.float32)
        logits_BCV = soft_cap(constrain(logits_BCV, ("batch", "length", "vocab"), rules), cap)
        target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
        return target_BC - jax.nn.logsumexp(logits_BCV, axis=-1)

    def body(_, xs_chunk):
        return None, chunk_logprobs(*xs_chunk)

    xs = (_split(x_BLD, chunk, strided), _split(targets_BL, chunk, strided))
    _, logprobs_CBc = jax.lax.scan(body, None, xs)
    return _unsplit(logprobs_CBc, strided)
