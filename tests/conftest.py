"""Test setup: 8 fake CPU devices, configured before anything imports jax."""

import atexit
import os
import shutil
import tempfile

from jaxtrain.xla_flags import with_device_count  # noqa: E402 - imports nothing heavy

# Most of this suite's time is XLA:CPU compiling tiny programs, and most of that is LLVM
# optimising their loops: at -O0 a compile takes about a third of the time (40.8 s -> 12.6 s
# for a pipeline equivalence test). It changes how fast the code runs, not what it computes
# (HLO passes, fusion and buffer assignment are the same, so compiled memory is too), and the
# CLI subprocesses, ranks and compile checks inherit it with the device count
# (xla_flags.with_device_count). Benchmarks (scripts/) never run with it. A caller's own
# level wins.
#
# XLA:CPU's newer MLIR fusion emitters take 2-3x longer to compile a fusion than the
# elemental LLVM IR emitters they replace, at -O0 as at -O2 (train steps of three layouts:
# 5.6 s -> 2.2 s; tests/parallel/test_pipeline.py: 107 s -> 64 s of CPU). The flag picks
# how XLA:CPU writes a fusion's loops after the same HLO passes (three steps of a llama
# and a gpt2 layout gave the same losses and parameters bit for bit either way), and it
# exists only on the CPU backend: GPU and TPU compiles never see it.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
if "--xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = with_device_count(8, _flags)
os.environ["JAX_PLATFORMS"] = "cpu"
# One persistent compilation cache for the session, for the pytest workers and the CLI
# subprocesses they start: a resumed run, a relaunched rank or a test on the same shapes in
# the other worker reuses the executable instead of compiling it again (most of this
# suite's time is XLA compiling). Fresh per session, so no run of the suite depends on
# another's leftovers. (It was off in the workers for a day while a worker segfault was
# blamed on its serialisation; the cause was the memory-map limit below.)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxtrain-test-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
# MFU's peak for every run the suite starts, in process or as a CLI subprocess, instead of
# each one timing a 2048x2048 matmul (about a second of each start on 2 busy cores). No test
# reads an MFU against a measured peak; test_diagnostics measures one on its own.
os.environ.setdefault("JAXTRAIN_PEAK_TFLOPS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxtrain.config import apply_overrides, base_config  # noqa: E402


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _executables_released(request):
    """Frees each test file's compiled programs when the file is done, and fails loudly
    where a file piles up memory maps.

    XLA:CPU keeps every compiled kernel in memory maps of its own, and jax's caches keep
    every executable alive. A long-lived pytest worker that passes vm.max_map_count (65530)
    gets SIGSEGV from the next compile, in whatever test comes next, and pytest-xdist then
    waits for ever. That happened in every full run on 2026-12-07: an eager sampler drew
    800 times through a fresh lambda, compiling a new program per draw (48k maps in one
    file; a typical file adds a few hundred).
    """
    before = _memory_maps()
    yield
    limit, grown = _max_map_count(), _memory_maps() - before
    jax.clear_caches()
    left = _memory_maps()
    if grown > limit // 4 or left > limit // 2:
        pytest.fail(f"{request.node.nodeid} added {grown} memory maps to this worker, and "
                    f"{left} are left after jax.clear_caches() (vm.max_map_count={limit}): "
                    "something compiles a new program per call (an eager jax call on a "
                    "fresh lambda), or keeps compiled programs alive", pytrace=False)


def small_config(family: str = "gpt2", **overrides):
    """A model small enough for a 2-core CPU that every mesh in the tests can split."""
    c = base_config()
    c.steps = 3
    c.log_every_steps = 1
    c.model.family = family
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 8
    c.model.num_kv_heads = 4 if family == "llama" else 0
    c.model.mlp_dim = 128
    c.model.vocab_size = 256
    c.model.seq_len = 32
    c.train.global_batch = 16
    c.optimizer.lr = 1e-3
    c.optimizer.warmup_steps = 1
    # Adam divides each gradient entry by its own size, so an entry whose gradient is near
    # zero turns the float noise of another reduction order into a visible change; eps 1e-6
    # (not 1e-8) bounds that amplification without changing what the test compares.
    c.optimizer.eps = 1e-6
    c.mesh.data = 1
    return apply_overrides(c, overrides)


@pytest.fixture(scope="session")
def devices():
    assert jax.device_count() == 8, "conftest must set 8 fake devices before jax loads"
    return jax.devices()


# Object storage (tests/servers.py): one server of each kind per test process, started on
# first use; `bucket` gives each test a new bucket on either, as a URL.
_servers: dict = {}


def object_server(scheme: str):
    if scheme not in _servers:
        from servers import start
        _servers[scheme] = start(scheme)
        atexit.register(_servers[scheme].stop)
    return _servers[scheme]


@pytest.fixture(params=["s3", "gs"])
def bucket(request):
    server = object_server(request.param)
    server.proxy.delay_s = 0.0
    server.proxy.up()
    return server.bucket()
