"""The package's shape: dependencies point down the layers, no cycles, and module-level
imports except where a dependency must load late (jax after a re-exec or fake-device flags)
or is heavy and optional."""

import ast
import os
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "jaxtrain"

# Lowest first. A module may import its own layer and the ones below, never one above.
LAYERS = [
    ("errors", "precision", "hostmem", "hardware", "distributed", "signals", "xla_flags",
     "retry", "storage", "lease", "outbox"),
    ("mesh",),
    ("parallel",),
    ("models",),
    ("data", "prepare", "rl", "optim", "checkpoint", "checkpoint_tier", "workdir",
     "checkpoint_local", "checkpoint_remote", "checkpoint_shards", "fingerprints", "rotation",
     "metrics", "sinks", "metrics_log", "tasks"),
    # Above the data it trains on: data/ never asks an objective (an error it phrases names
    # the layout, not the objectives that take it).
    ("objectives",),
    ("config",),
    ("train.state", "train.frozen", "train.step", "train.setup", "train.faults", "train.hooks",
     "train.profiling", "train.preemption", "train.goodput", "train.watchdog"),
    # decoding and scoring parameters, for the loop and commands; the generation engine
    ("sampling", "scoring", "engine"),
    ("train",),  # the loop and its hooks
    # engine.run_io: a run's EOS ids and chat template, for generate and serve
    ("inference", "quantization", "hf", "plan", "run_record", "engine.run_io", "serve"),
    # The planner's calibration pipeline (python -m jaxtrain.plan.calibrate.NAME): it
    # compiles and fits what plan/ reads from its JSON files; nothing imports it.
    ("plan.calibrate",),
    ("commands", "main", "__main__"),
]

# Function-level imports: third-party modules that are heavy and needed by one path only,
# and, in commands, the package itself where jax must load after the command has set up
# its process (train: the huge-pages re-exec; plan --compile: fake devices).
LATE_THIRD_PARTY = ("matplotlib", "tensorboardX", "ml_dtypes", "jax.experimental",
                    # the [data] extra and transformers: optional, so imported where used
                    "pyarrow", "datasets", "sentencepiece", "tiktoken", "transformers",
                    # the [eval] and [wandb] extras
                    "lm_eval", "wandb",
                    # the [ray] extra: `prepare --ray` only
                    "ray",
                    # the [serve] extra: `jaxtrain serve` only
                    "fastapi", "uvicorn",
                    # loaded only in tpu_aot_check's compile-only process (its environment)
                    "libtpu")
LATE_ALLOWED_IN = ("commands.train", "commands.plan", "commands.common",
                   # main: the train command after the re-exec, not before it as well
                   "main",
                   # jax after fake-device flags, or in a process re-run for libtpu
                   "plan.calibrate.plan_vs_compiler", "plan.calibrate.tpu_aot_check")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _layer(module: str) -> int:
    best, length = None, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > length:
                best, length = index, len(name)
    assert best is not None, f"jaxtrain.{module} is in no layer of {__file__}"
    return best


def _imports(path: pathlib.Path):
    """(imported module, line, at module level) for every import of the file."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield name, node.lineno, id(node) in top


def _package_imports(path):
    """(jaxtrain module, line, at module level): `from a.b import c` counts as an import of
    a.b.c where that is a module, else of a.b."""
    known = {m for m, _ in _modules()}
    for name, line, top in _imports(path):
        parts = name.split(".")
        if parts[0] != "jaxtrain":
            continue
        for end in range(len(parts), 1, -1):
            target = ".".join(parts[1:end])
            if target in known:
                yield target, line, top
                break


def test_every_module_has_a_layer():
    for module, _ in _modules():
        if module:
            _layer(module)


def test_no_import_points_up_a_layer():
    upward = []
    for module, path in _modules():
        if not module:
            continue
        for target, line, _ in _package_imports(path):
            if _layer(target) > _layer(module):
                upward.append(f"jaxtrain/{path.relative_to(PACKAGE)}:{line} {module} "
                              f"(layer {_layer(module)}) imports {target} (layer {_layer(target)})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = {module: {t for t, _, _ in _package_imports(path)} - {module}
             for module, path in _modules() if module}
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_function_level_imports_only_where_needed():
    found = []
    for module, path in _modules():
        for name, line, top in _imports(path):
            if top or name.startswith(LATE_THIRD_PARTY) or name.endswith(".*"):
                continue
            if name.startswith("jaxtrain") or name.split(".")[0] in ("jax", "numpy"):
                if module.startswith(LATE_ALLOWED_IN):
                    continue
            found.append(f"jaxtrain/{path.relative_to(PACKAGE)}:{line} imports {name} inside "
                         "a function")
    assert not found, "\n".join(found)


# Who may import the offline preparation package (jaxtrain/prepare/): its command only.
# Training, evaluation and the rest read prepared datasets through jaxtrain.data. And
# engine.run_io: generate --chat and serve render a conversation with the chat template
# exactly as prepare --chat rendered the training data (prepare/chat_template.py).
# The chat template is prepare's (prepare --chat renders it); the engine renders with it and
# an import keeps the model's own beside its tokenizer.
PREPARE_IMPORTED_BY = ("prepare", "commands.prepare", "engine.run_io", "hf.load")


def test_only_the_prepare_command_imports_the_offline_package():
    found = [f"jaxtrain/{path.relative_to(PACKAGE)}:{line} {module} imports {target}"
             for module, path in _modules() if module
             and not module.startswith(PREPARE_IMPORTED_BY)
             for target, line, _ in _package_imports(path)
             if target == "prepare" or target.startswith("prepare.")]
    assert not found, "\n".join(found)


def test_the_offline_package_imports_no_jax():
    """Every module of jaxtrain/prepare/, imported in a fresh process, loads neither jax nor
    grain: a prepare and each of its spawned workers stay light (jaxtrain.data's lazy
    __getattr__ is what keeps `import jaxtrain.data.x` from loading the grain pipeline)."""
    import subprocess
    import sys

    modules = sorted(f"jaxtrain.{m}" for m, _ in _modules() if m.startswith("prepare"))
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'grain'))\n"
            "print(heavy)\n"
            "sys.exit(1 if heavy else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, env={**os.environ,
                                                    "PYTHONPATH": str(PACKAGE.parent)})
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk above finds what it is meant to find: a planted models -> train import."""
    fake = tmp_path / "jaxtrain"
    (fake / "models").mkdir(parents=True)
    (fake / "train").mkdir()
    (fake / "models" / "bad.py").write_text("from jaxtrain.train.loop import run\n")
    (fake / "train" / "loop.py").write_text("import jax\n\ndef f():\n    import numpy\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    with pytest.raises(AssertionError, match=r"models.bad \(layer 3\) imports train.loop"):
        test_no_import_points_up_a_layer()
    with pytest.raises(AssertionError, match="imports numpy inside a function"):
        test_function_level_imports_only_where_needed()


def _entry_cases():
    """(config overrides, registry, name, entry, devices): a new choice, added as one
    entry; the first override is the choice, the others what it needs to run (an MoE
    model, a context or pipeline axis of `devices`)."""
    import jax
    import optax

    from jaxtrain.data.sources import SOURCES, DataSource, SyntheticWindows
    from jaxtrain.models.attention import (
        KERNELS,
        VARIANTS,
        AttentionKernel,
        ContextVariant,
        xla_attention,
    )
    from jaxtrain.models.families import FAMILIES, Family
    from jaxtrain.models.moe import DISPATCHES, Dispatch, check_mesh
    from jaxtrain.models.remat import REMATS, Remat
    from jaxtrain.optim import OPTIMIZERS, Optimizer
    from jaxtrain.parallel.pipeline import SCHEDULES, Schedule
    from jaxtrain.precision import PRECISIONS, Precision

    def constant_splits(c):
        return (SyntheticWindows(c.model.vocab_size, c.model.seq_len, 7),
                SyntheticWindows(c.model.vocab_size, c.model.seq_len, 8, size=64))

    from jaxtrain.data.layouts import LAYOUTS, BatchLayout
    from jaxtrain.data.packing import Packed
    from jaxtrain.objectives import OBJECTIVES, Objective, objective_fn

    class Halves:
        """Synthetic rows of two documents, one per half of the row."""

        def __init__(self, vocab, seq, seed, size=1 << 30):
            self.vocab, self.seq, self.seed, self.size = vocab, seq, seed, size

        def __len__(self):
            return self.size

        def __getitem__(self, index):
            import numpy as np
            tokens = np.random.default_rng((self.seed, index)).integers(
                0, self.vocab, self.seq + 1, dtype=np.int32)
            half = (self.seq + 1) // 2
            segments = np.r_[np.ones(half), np.full(self.seq + 1 - half, 2)].astype(np.int32)
            positions = np.r_[np.arange(half), np.arange(self.seq + 1 - half)].astype(np.int32)
            return Packed(tokens, segments, positions)

    def halves_unread(*args):
        raise AssertionError("synthetic only")

    def doubled_losses(graphdef, reference_graphdef, cfg):
        scale = cfg.train.doubled.scale

        def loss(params, tokens, step, reference):
            value, metrics = objective_fn(params, graphdef, tokens)
            return scale * value, metrics

        return loss, lambda params, tokens: {"weight": 1.0, "loss": loss(
            params, tokens, 0, None)[0]}

    moe = {"model.family": "llama", "model.num_kv_heads": 4, "model.moe.num_experts": 4,
           "model.moe.top_k": 2}
    ring = VARIANTS["ring"]
    return {
        "remat": ({"model.remat": "save_qkv"}, REMATS, "save_qkv", Remat(
            "save_qkv", "keep q, k, v", jax.checkpoint_policies.save_only_these_names(
                "query_proj", "key_proj", "value_proj"), saves="input", recomputes="forward"),
            1),
        "attention": ({"model.attention": "xla_copy"}, KERNELS, "xla_copy", AttentionKernel(
            "xla_copy", xla_attention, "the reference again", ("cpu", "gpu", "tpu"),
            full_scores=True), 1),
        "precision": ({"train.precision": "bf16_plain"}, PRECISIONS, "bf16_plain", Precision(
            "bf16_plain", jax.numpy.bfloat16, "bf16 compute"), 1),
        "data": ({"data.source": "seven"}, SOURCES, "seven", DataSource(
            "seven", "synthetic tokens of another seed", constant_splits), 1),
        # A family made only of existing parts (attention options included): no other file.
        "family": ({"model.family": "parts_only"}, FAMILIES, "parts_only", Family(
            "parts_only", "RMSNorm, SwiGLU, RoPE, tied head, q/k/v biases and q/k norms",
            norm="rms", bias=False, rope=True, tied_embeddings=True, mlp="swiglu",
            attention=("qkv_bias", "qk_norm")), 1),
        # A dispatch path: buffers of every row (capacity_factor E/k: nothing drops).
        "dispatch": ({"model.moe.dispatch": "padded_all", **moe,
                      "model.moe.capacity_factor": 2.0}, DISPATCHES, "padded_all", Dispatch(
            "padded_all", "capacity buffers", DISPATCHES["capacity"].run, (), check_mesh,
            padded=True), 1),
        "context": ({"model.context_attention": "ring2", "mesh.context": 2}, VARIANTS,
                    "ring2", ContextVariant(
            "ring2", "the ring again", ring.forward, ring.backward, grouped_kv=False,
            check=ring.check, kv_blocks=2, hops=True), 2),
        "schedule": ({"pipeline.schedule": "gpipe2", "mesh.pipeline": 2,
                      "pipeline.microbatches": 2}, SCHEDULES, "gpipe2", Schedule(
            "gpipe2", "one block per stage", SCHEDULES["gpipe"].check), 2),
        "optimizer": ({"optimizer.name": "sgd_momentum", "optimizer.lr": 0.1}, OPTIMIZERS,
                      "sgd_momentum", Optimizer(
            "sgd_momentum", "SGD with heavy-ball momentum b1",
            lambda schedule, o, mask: optax.sgd(schedule, momentum=o.b1),
            state_per_param=1), 1),
        "layout": ({"data.packing": "halves", "data.source": "synthetic"}, LAYOUTS, "halves",
                   BatchLayout("halves", "two documents a row", halves_unread, halves_unread,
                               halves_unread, lambda rows: Packed(rows, rows, rows),
                               synthetic=Halves, segments=True, documents=True), 1),
        "objective": ({"train.objective": "doubled"}, OBJECTIVES, "doubled", Objective(
            "doubled", "twice the cross entropy", doubled_losses, lambda c: None,
            weighting="targets", defaults=lambda: {"scale": 2.0}), 1),
    }


@pytest.mark.slow  # trains two steps per case: a compile each
@pytest.mark.parametrize("case", ["remat", "attention", "precision", "data", "family",
                                  "dispatch", "context", "schedule", "optimizer", "layout",
                                  "objective"])
def test_a_new_choice_is_one_registry_entry(case, monkeypatch, devices):
    """Adding a remat policy, an attention kernel, a precision, a data source, a model
    family, an MoE dispatch path, a context variant, a pipeline schedule, an optimizer, a
    batch layout or an objective (with its own config section, train.<name>) is one
    registry entry: validation accepts it, a typo lists it, the planner reads its facts,
    and it trains."""
    import math

    from conftest import small_config
    from helpers import train_steps

    from jaxtrain import hardware
    from jaxtrain.config import validate
    from jaxtrain.errors import ConfigError
    from jaxtrain.plan.planner import make_plan

    overrides, registry, name, entry, count = _entry_cases()[case]
    key = next(iter(overrides))
    with pytest.raises(ConfigError, match=rf"{key}='{name}' is invalid"):
        validate(small_config(**overrides), count, "cpu")
    monkeypatch.setitem(registry, name, entry)
    with pytest.raises(ConfigError, match=rf"valid values are .*{name}"):
        validate(small_config(**{**overrides, key: name + "x"}), count, "cpu")
    plan = make_plan(small_config(**overrides), hardware.get("H100-SXM"), count)
    assert plan["memory"]["total_bytes_per_device"] > 0
    losses, _, _ = train_steps(small_config(**overrides), devices[:count], steps=2)
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0] + 0.5


# The choices whose names the planner must never branch on: it reads their entries' facts.
def _feature_names() -> set[str]:
    from jaxtrain.models.attention import KERNELS, VARIANTS
    from jaxtrain.models.moe import DISPATCHES
    from jaxtrain.optim import OPTIMIZERS
    from jaxtrain.parallel.pipeline import SCHEDULES

    return {*KERNELS, *VARIANTS, *DISPATCHES, *SCHEDULES, *OPTIMIZERS}


# plan/ modules that hold config values as data, not as branches: the test grid's configs
# and the overrides the search generates. plan/calibrate/ is not walked (plan/*.py only, as
# below): it is the harness that compiles cases it picks by name (the splash kernel, a
# dropless step, CPU stand-ins for GPU kernels), not the planner.
PLAN_DATA = ("grid.py", "search.py")


def test_the_planner_names_no_kernel_or_variant():
    """plan/ reads the facts of the registry entries (attention kernels, context variants,
    MoE dispatch paths, pipeline schedules, optimizers): no module compares against one's
    name, and outside the config data (PLAN_DATA) none spells one."""
    names = _feature_names()
    for path in sorted((PACKAGE / "plan").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for part in [node.left, *node.comparators]:
                    assert not (isinstance(part, ast.Constant) and part.value in names), (
                        f"plan/{path.name}:{node.lineno} branches on {part.value!r}")
            if path.name not in PLAN_DATA and isinstance(node, ast.Constant):
                assert node.value not in names, (
                    f"plan/{path.name}:{node.lineno} names {node.value!r}: read a registry "
                    "entry's fact instead")


# What the planner may not import: a kernel's own modules (it reads their registry
# entries' facts: tiles, chunks), and the head and loss (the objective entry's logits_chunk).
KERNEL_INTERNALS = ("models.attention.", "models.head_loss")


def test_the_planner_imports_no_kernel_internals():
    found = [f"plan/{path.name}:{line} imports jaxtrain.{target}"
             for path in sorted((PACKAGE / "plan").glob("*.py"))
             for target, line, _ in _package_imports(path)
             if any(target.startswith(name) for name in KERNEL_INTERNALS)]
    assert not found, found


def test_a_new_tokenizer_kind_or_input_format_is_one_registry_entry(tmp_path, monkeypatch):
    """The offline side's choices: a tokenizer backend (data/tokenizers KINDS) and an input
    format (prepare/formats FORMATS) are each one entry. No config key picks them, so each is
    checked through a prepare: a typo lists the new name, and a dataset comes out of it."""
    from jaxtrain.data import tokenizers
    from jaxtrain.data.dataset import PreparedDataset
    from jaxtrain.data.tokenizers import ByteTokenizer, TokenizerKind
    from jaxtrain.errors import DataError
    from jaxtrain.prepare import formats, records
    from jaxtrain.prepare import pipeline as P
    from jaxtrain.prepare.formats import InputFormat

    class Shouting(ByteTokenizer):
        kind = "shouting"

        def encode(self, text):
            return super().encode(text.upper())

        def encode_batch(self, texts):
            return super().encode_batch([t.upper() for t in texts])

        def fingerprint(self):
            return tokenizers.base.sha256("shouting")

    def read_tsv(unit, i, item, options, tally, docs):  # the document is the second column
        for where, line in records.numbered_lines(unit, i, item, tally):
            tally.records += 1
            records.keep(records.decode(line.split(b"\t")[1], tally, where), docs, tally, where)

    monkeypatch.setitem(tokenizers.KINDS, "shouting", TokenizerKind(
        "shouting", "shouting", load_saved=lambda directory, meta, what: Shouting(),
        names=lambda spec: spec == "shouting", load_spec=lambda spec, what: Shouting()))
    monkeypatch.setitem(formats.FORMATS, "tsv", InputFormat(
        "tsv", units=formats.FORMATS["jsonl"].units, read=read_tsv,
        claims=lambda path: path.suffix == ".tsv", lines=True))
    with pytest.raises(DataError, match="give bytes, .*shouting"):
        tokenizers.load_tokenizer("shoutingx")
    (tmp_path / "a.tsv").write_text("1\tfirst doc\n2\tsecond\n")
    with pytest.raises(DataError, match="valid values are auto, .*tsv"):
        P.layout_inputs(P.Request.build([tmp_path / "a.tsv"], tmp_path / "x", format="tsvx",
                                        tokenizer="bytes"))
    P.prepare(P.Request.build([tmp_path / "a.tsv"], tmp_path / "ds", tokenizer="shouting",
                              processes=1, progress=False))  # in this process: patched
    ds = PreparedDataset(tmp_path / "ds")
    assert bytes(ds.read(0, ds.num_tokens).tolist()) == b"FIRST DOCSECOND"
    assert tokenizers.load_tokenizer(tmp_path / "ds" / "tokenizer").kind == "shouting"


# Test-only references: the package must run without them (pyproject's [test] extra only).
TEST_ONLY = ("peft", "trl", "torch")


def test_the_package_never_imports_its_test_only_references():
    found = [f"jaxtrain.{module}:{line} imports {name}" for module, path in _modules()
             for name, line, _ in _imports(path) if name.split(".")[0] in TEST_ONLY]
    assert not found, found


# A function longer than this says why in a comment holding "on purpose" (issue #27).
MAX_FUNCTION_LINES = 60


def _long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for module, path in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = lines[node.lineno - 1:node.end_lineno]
            if len(body) > limit and not any(
                    "#" in line and "on purpose" in line for line in body):
                found.append(f"jaxtrain.{module}:{node.lineno} {node.name} ({len(body)} lines)")
    return found


def test_no_long_function_without_a_reason():
    """Functions stay under MAX_FUNCTION_LINES, or carry a comment saying why they do not
    (the pipeline's scan body closes over the schedule's shapes)."""
    assert not _long_functions(), _long_functions()
    # The walk sees long functions (at a limit of 40 some are found), and excuses the
    # pipeline by its comment alone.
    shorter = _long_functions(40)
    assert shorter and not any(" pipeline (" in f for f in shorter)


def test_no_module_tests_a_layout_or_objective_name():
    """Batch layouts (data/layouts.py) and objectives (objectives.py) are read by their
    entries' fields: no module compares a value with one's name (`packing == "pairs"`),
    and only their own registries spell one, or hold config data (defaults, PLAN_DATA)."""
    from jaxtrain.data.layouts import LAYOUTS
    from jaxtrain.objectives import OBJECTIVES

    names = {*LAYOUTS, *OBJECTIVES}
    found = []
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                found += [f"jaxtrain.{module}:{node.lineno} compares with {part.value!r}"
                          for part in [node.left, *node.comparators]
                          if isinstance(part, ast.Constant) and part.value in names]
    assert not found, found
