"""Measured matmul throughput of one device per dtype (bf16, fp8 e4m3 with bf16 output, fp32),
printed as one JSON line: the ceilings that MFU and fp8 speed-ups are judged against.

    python scripts/bench_matmul_peak.py [--n 8192]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp


def throughput(dtype, n: int, out_dtype=None, repeats: int = 10) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=out_dtype or dtype))
    f(a, b).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = f(a, b)
    out.block_until_ready()
    return 2.0 * n ** 3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8192)
    n = parser.parse_args().n
    result = {"check": "matmul_peak", "device_kind": jax.devices()[0].device_kind, "n": n}
    for name, dtype, out in (("bf16", jnp.bfloat16, None), ("fp32", jnp.float32, None),
                             ("fp8_e4m3", jnp.float8_e4m3fn, jnp.bfloat16)):
        try:
            result[f"{name}_tflops"] = throughput(dtype, n, out) / 1e12
        except Exception as e:  # noqa: BLE001 - a dtype the device lacks is a result too
            result[f"{name}_error"] = str(e).splitlines()[0][:200]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
