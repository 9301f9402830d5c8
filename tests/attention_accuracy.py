"""Every attention kernel that runs on this backend against the float32 reference, one row
each: the largest relative difference of outputs and of q/k/v gradients against `xla`
computed in float32, and the time of a forward+backward.

On a GPU this covers `cudnn` and `pallas` (which the CPU tests cannot run natively), in
bfloat16, with grouped-query heads and with a sliding window; on CPU, `chunked` in float32.
The accelerator harness prints the rows on the day (scripts/accelerator/attention_check.py,
run by gpu_check.sh); tests/unit/test_accelerator_checks.py runs the CPU rows, so that the
check is known to work before a GPU is lent.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxtrain.models.attention import KERNELS

IMPLS = {"cpu": ["chunked"], "gpu": ["cudnn", "pallas", "chunked"], "tpu": ["chunked"]}
# batch, query heads, kv heads (grouped-query), head dim
SHAPE = (2, 16, 4, 128)


def _relative(a, ref) -> float:
    return float(jnp.abs(a.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())


def rows(length: int = 1024, windows=(None, 256), shape=SHAPE):
    """Yields one row per kernel of this backend and window."""
    platform = jax.devices()[0].platform
    dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
    b, heads, groups, head_dim = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, length, heads, head_dim)) * head_dim ** -0.5
    k = jax.random.normal(keys[1], (b, length, groups, head_dim))
    v = jax.random.normal(keys[2], (b, length, groups, head_dim))
    cot = jax.random.normal(keys[3], (b, length, heads, head_dim))

    def loss_and_grads(name, window, dt):
        fn = lambda q, k, v: KERNELS[name](q.astype(dt), k.astype(dt), v.astype(dt),  # noqa
                                             window).astype(jnp.float32)
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.vdot(fn(q, k, v), cot),
                                          argnums=(0, 1, 2)))

    for window in windows:
        reference = loss_and_grads("xla", window, jnp.float32)
        out_ref = jax.jit(lambda q, k, v: KERNELS["xla"](q, k, v, window))(q, k, v)
        _, grads_ref = reference(q, k, v)
        for name in IMPLS[platform]:
            if name == "pallas" and window is not None:
                continue  # no window in jax's Pallas GPU kernel (refused at config time)
            row = {"check": "attention", "platform": platform, "impl": name,
                   "dtype": jnp.dtype(dtype).name, "window": window, "length": length}
            try:
                out = jax.jit(lambda q, k, v: KERNELS[name](
                    q.astype(dtype), k.astype(dtype), v.astype(dtype), window))(q, k, v)
                step = loss_and_grads(name, window, dtype)
                _, grads = jax.block_until_ready(step(q, k, v))
                start = time.perf_counter()
                jax.block_until_ready(step(q, k, v))
                row["fwd_bwd_ms"] = round((time.perf_counter() - start) * 1e3, 2)
                row["out_rel_err"] = _relative(out, out_ref)
                row["grad_rel_err"] = max(_relative(g, r) for g, r in zip(grads, grads_ref))
            except Exception as e:  # noqa: BLE001 - report and go on to the next kernel
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            yield row
