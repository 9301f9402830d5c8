"""The TPU splash-attention kernel (models/attention/splash.py), run in Pallas's interpreter on CPU,
matches the float64 reference (tests/helpers.py attention_f64) in outputs and gradients:
causal, grouped-query and multi-query, with and without a sliding window, unsharded and
sharded over a mesh."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import attention_f64, attention_inputs, relative_error
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config import MESH_AXES
from jaxtrain.models.attention import xla_attention
from jaxtrain.models.attention.splash import splash_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(b, length, heads, groups, head_dim, seed=0):
    """helpers.attention_inputs with q at 1/sqrt(head_dim), k unscaled."""
    return attention_inputs(b, length, heads, groups, head_dim, seed,
                            q_scale=head_dim ** -0.5, k_scale=1.0)


def _output_and_grads(fn, q, k, v, cotangent):
    out = jax.jit(fn)(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.vdot(fn(q, k, v), cotangent),
                             argnums=(0, 1, 2)))(q, k, v)
    return out, grads


# Length 256 in blocks of 128: the kernel's skipping of masked blocks and its partial blocks
# (the diagonal, and a window of 100 that cuts across blocks) are all exercised.
CASES = [
    ((1, 256, 4, 2, 16), None),   # grouped-query, causal
    ((1, 256, 4, 1, 16), None),   # multi-query
    ((1, 256, 4, 2, 16), 100),    # grouped-query, window inside a block pair
    ((2, 256, 4, 4, 8), 128),     # multi-head, window of exactly one block
]


@pytest.mark.parametrize("shape,window", CASES)
def test_splash_matches_the_float64_reference(shape, window):
    q, k, v, cotangent = _inputs(*shape)
    got = _output_and_grads(lambda q, k, v: splash_attention(q, k, v, window, block=128),
                            q, k, v, cotangent)
    want = attention_f64(q, k, v, window, None, cotangent)
    assert got[0].dtype == q.dtype
    assert relative_error(got[0], want[0]) < 1e-5
    for g, w in zip(got[1], want[1]):
        assert relative_error(g, w) < 1e-5
    if window is None:  # and the model's own reference, which it replaces
        assert relative_error(got[0], xla_attention(q, k, v)) < 1e-5


def test_window_limits_what_a_query_sees():
    q, k, v, _ = _inputs(1, 256, 2, 1, 8)
    before = splash_attention(q, k, v, 64, block=128)
    # Keys more than 63 positions back are out of every query's window from position 200 on.
    v_early = v.at[:, :137].set(0.0)
    np.testing.assert_allclose(splash_attention(q, k, v_early, 64, block=128)[:, 200:],
                               before[:, 200:], atol=1e-6)


@pytest.mark.parametrize("groups", [2, 1])
def test_sharded_over_batch_and_heads(devices, groups):
    """Under a data×fsdp×tensor mesh each device runs the kernel on its own examples and
    heads (a shard_map); with one kv head and tensor=2 the kv head is repeated per q head."""
    q, k, v, cotangent = _inputs(4, 128, 4, groups, 8)
    shape = {"data": 2, "pipeline": 1, "fsdp": 2, "tensor": 2, "expert": 1, "context": 1}
    mesh = Mesh(np.asarray(devices).reshape([shape[a] for a in MESH_AXES]), MESH_AXES)
    batch = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
    q, cotangent = jax.device_put((q, cotangent), batch)
    k, v = jax.device_put((k, v), NamedSharding(mesh, P(("data", "fsdp"))))
    with jax.set_mesh(mesh):
        got = _output_and_grads(splash_attention, q, k, v, cotangent)
    want = attention_f64(q, k, v, None, None, cotangent)
    assert relative_error(got[0], want[0]) < 1e-5
    for g, w in zip(got[1], want[1]):
        assert relative_error(g, w) < 1e-5


@pytest.mark.slow
def test_in_the_model_on_a_pipeline_fsdp_tensor_mesh(devices):
    """model.attention='splash' (what 'pallas' and 'auto' resolve to on TPU), windowed, on a
    pipeline×fsdp×tensor mesh: the loss and gradients of the reference kernel."""
    from conftest import small_config

    from jaxtrain.data.batches import make_batches, to_global
    from jaxtrain.train.setup import build
    from jaxtrain.train.step import loss_fn

    results = []
    for kernel in ("xla", "splash"):
        cfg = small_config("llama", **{"model.seq_len": 128, "model.attention": kernel,
                                       "model.sliding_window": 48, "train.global_batch": 8,
                                       "mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
        setup = build(cfg, devices)
        state = setup.init_state()
        tokens = to_global(next(make_batches(cfg).train_iter(0)), setup.tokens_sharding)
        with jax.set_mesh(setup.mesh):
            results.append(jax.jit(jax.value_and_grad(
                lambda p, t: loss_fn(p, setup.graphdef, t)))(state.params, tokens))
    (loss, grads), (want_loss, want_grads) = results[1], results[0]
    assert abs(float(loss) - float(want_loss)) < 1e-5 * abs(float(want_loss))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < 1e-5


def test_rejects_lengths_the_kernel_cannot_tile():
    q, k, v, _ = _inputs(1, 96, 2, 1, 8)
    with pytest.raises(ValueError, match="multiples of 128"):
        splash_attention(q, k, v)


def _libtpu_site():
    """Where libtpu is importable from, kept out of the test process: LIBTPU_SITE, else
    /tmp/libtpu_site (see plan/calibrate/tpu_aot_check.py); None when neither holds it."""
    site = os.environ.get("LIBTPU_SITE", "/tmp/libtpu_site")
    return site if os.path.isdir(os.path.join(site, "libtpu")) else None


@pytest.mark.slow
@pytest.mark.skipif(_libtpu_site() is None,
                    reason="libtpu not installed (pip install --target /tmp/libtpu_site "
                           "'libtpu==0.0.42.*'); the TPU ahead-of-time compile check needs it")
def test_tpu_aot_compile_of_offload_and_splash():
    """On a v5e topology from libtpu (no TPU): offloaded Adam moments compile into host
    memory, and the splash kernel compiles for TPU (the module exits 1 on any problem)."""
    done = subprocess.run(
        [sys.executable, "-m", "jaxtrain.plan.calibrate.tpu_aot_check",
         "--cases", "tiny,splash", "--libtpu_site", _libtpu_site()],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "problems: none" in done.stdout
