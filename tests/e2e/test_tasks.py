"""Downstream tasks through lm-evaluation-harness: the scorer, the harness model, in the
loop (and into every metric sink and the report) and from the command line. The sinks
themselves, W&B included: tests/unit/test_sinks.py."""

import json
import pathlib
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from flax import nnx
from log_readers import metrics_rows, rows_by_step

from jaxtrain.config import validate
from jaxtrain.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK = "items"  # the JSONL task's name: its file's stem
ITEMS = [  # multiple choice, label 0 the right answer; lm_eval adds the space before a choice
    {"question": "def f(x):\n    return", "choices": ["x", "1 +", "None"], "label": 0},
    {"question": "import os\nimport", "choices": ["sys", "zzz", "re"], "label": 0},
    {"question": "for i in", "choices": ["range(10):", "qq", ")("], "label": 0},
    {"question": "class A:\n    def", "choices": ["__init__(self):", "7", "+"], "label": 0},
]
# The YAML lines of a generation task and of a rolling log-likelihood one (_task_yaml).
GENERATE = ('generation_kwargs: {until: ["\\n\\n"], max_gen_toks: 12, do_sample: false}',
            "metric_list: [{metric: exact_match}]")
PROMPTS = [{"prompt": "def ", "target": "f"}, {"prompt": "import os\n", "target": "x"}]
ROLLING = ("metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, "
           "{metric: bits_per_byte}]",)
# One text within a window of model.seq_len=64, one over two windows.
TEXTS = [{"text": "def add(a, b):\n    return a + b\n"},
         {"text": "import sys\n\n\ndef main(argv):\n    for arg in argv[1:]:\n"
                  "        print(arg.upper())\n    return 0\n\n\nsys.exit(main(sys.argv))\n"}]
RUN_OVERRIDES = {"steps": 4, "log_every_steps": 2, "eval_every_steps": 2,
                 "checkpoint.every_steps": 2, "model.seq_len": 64, "train.global_batch": 8,
                 "optimizer.lr": 3e-3, "eval.tasks_every_steps": 2, "eval.tasks_batch": 4,
                 "metrics.sinks": "jsonl,tensorboard"}


def _task_yaml(task: str, path, output_type: str, text: str, target: str, *more: str) -> str:
    """lm_eval's YAML of `task` over the JSONL file `path`: its rows' `text` and `target`
    fields, then `more` lines."""
    return "\n".join([f"task: {task}", "dataset_path: json",
                      f"dataset_kwargs: {{data_files: {{test: {path}}}}}", "test_split: test",
                      f"output_type: {output_type}", f'doc_to_text: "{{{{{text}}}}}"',
                      f'doc_to_target: "{{{{{target}}}}}"', *more, ""])


def _write_lines(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    _write_lines(d / f"{TASK}.jsonl", ITEMS)
    (d / "gen.yaml").write_text(_task_yaml("gen", _write_lines(d / "gen.jsonl", PROMPTS),
                                           "generate_until", "prompt", "target", *GENERATE))
    (d / "roll.yaml").write_text(_task_yaml("roll", _write_lines(d / "roll.jsonl", TEXTS),
                                            "loglikelihood_rolling", "text", "text", *ROLLING))
    return d


@pytest.fixture(scope="module")
def task_run(tmp_path_factory, task_files, devices):
    """A byte-level run of 4 steps scoring the JSONL task and the rolling one every 2 steps
    into metrics.jsonl and TensorBoard, then resumed to step 6."""
    from jaxtrain.train.loop import run

    workdir = tmp_path_factory.mktemp("run")
    tasks = f"{task_files / f'{TASK}.jsonl'},{task_files / 'roll.yaml'}"
    cfg = small_config(**RUN_OVERRIDES, **{"eval.tasks": tasks})
    run(cfg, workdir, devices[:1])
    cfg.steps = 6
    run(cfg, workdir, devices[:1])
    return workdir


def _direct_forward(graphdef):
    if id(graphdef) not in _FORWARD:  # graph definitions do not hash
        _FORWARD[id(graphdef)] = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    return _FORWARD[id(graphdef)]


_FORWARD: dict = {}


def _direct_logprob(loaded, context: list[int], continuation: list[int]):
    """log P(continuation | context) and greedy-or-not from one unpadded forward pass of the
    model on one device (remembered: every mesh's test compares with the same numbers)."""
    key = (str(loaded.setup.cfg.model), tuple(context), tuple(continuation))
    if key not in _DIRECT:
        _DIRECT[key] = _unpadded_logprob(loaded, context, continuation)
    return _DIRECT[key]


_DIRECT: dict = {}


def _unpadded_logprob(loaded, context: list[int], continuation: list[int]):
    whole = (context + continuation)[-65:]
    with jax.set_mesh(loaded.setup.mesh):
        logits = _direct_forward(loaded.setup.graphdef)(
            loaded.params, jnp.asarray([whole[:-1]], jnp.int32))[0].astype(jnp.float32)
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    targets = whole[1:]
    span = range(len(targets) - len(continuation), len(targets))
    greedy = all(int(np.argmax(logprobs[p])) == targets[p] for p in span)
    return sum(float(logprobs[p, targets[p]]) for p in span), greedy


def _split_like_lm_eval(context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness moves a context's trailing spaces to the continuation before encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    return list(context.encode()), list(continuation.encode())


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [1, 2])
def test_harness_loglikelihoods_are_the_models(task_run, task_files, tensor, devices):
    """Multiple-choice and rolling log-likelihoods scored through lm_eval (batched, padded,
    bucketed, on a tensor=2 mesh too) equal one unpadded forward pass per request."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from jaxtrain import inference
    from jaxtrain.data.tokenizers import ByteTokenizer
    from jaxtrain.tasks import BACKENDS, TaskSpec

    tasks = BACKENDS["lm_eval"].load(TaskSpec((str(task_files / f"{TASK}.jsonl"),
                                               str(task_files / "roll.yaml"))))
    scorer, _ = inference.task_scorer(task_run, tensor=tensor, batch=4, devices=devices)
    results = tasks.evaluate(scorer, ByteTokenizer(), log_samples=True)
    loaded = inference.load(task_run, devices=devices[:1])
    docs = results.details["samples"][TASK]  # one per item: a request per choice
    assert len(docs) == len(ITEMS)
    for doc in docs:
        for arguments, ((got, got_greedy),) in zip(doc["arguments"], doc["resps"]):
            want, greedy = _direct_logprob(loaded, *_split_like_lm_eval(*arguments))
            assert got == pytest.approx(want, rel=1e-5, abs=1e-5), arguments
            assert got_greedy == greedy
    windows_per_text = []
    for doc in results.details["samples"]["roll"]:
        tokens = list(doc["arguments"][0][0].encode())
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            tokens, prefix_token=ord("\n"), max_seq_len=64, context_len=1)]
        want = sum(_direct_logprob(loaded, list(c), list(p))[0] for c, p in windows)
        assert doc["resps"][0][0] == pytest.approx(want, rel=1e-5)
        windows_per_text.append(len(windows))
    assert sorted(windows_per_text) == [1, 2]  # the long text took two windows
    accuracy = np.mean([np.argmax([resp[0][0] for resp in doc["resps"]]) == doc["doc"]["label"]
                        for doc in docs])
    assert results.scores[f"tasks/{TASK}/acc"] == pytest.approx(accuracy)


@pytest.mark.slow
def test_scorer_gives_one_devices_numbers_on_every_mesh(devices):
    """Pipeline stages, fsdp × tensor with sequence parallelism, data × fsdp: the scores and
    greedy continuations of one device (the loop scores on whatever mesh it trains on)."""
    from jaxtrain.scoring import Scorer
    from jaxtrain.train.setup import build

    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 256, rng.integers(1, 30)).tolist(),
              rng.integers(0, 256, rng.integers(1, 4)).tolist()) for _ in range(5)]
    prompts = [context[:10] for context, _ in pairs[:3]]
    overrides = {"model.init_std": 0.3, "train.global_batch": 8}
    one = build(small_config("llama", **overrides), devices[:1])
    params = one.init_state().params
    reference = Scorer.from_setup(one, 4, params, progress=False)
    want, continuations = reference.loglikelihoods(pairs), reference.generate(prompts, 4)
    for mesh, count in (({"mesh.pipeline": 2, "pipeline.microbatches": 2}, 2),
                        ({"mesh.fsdp": 2, "mesh.tensor": 2, "mesh.sequence_parallel": True}, 4),
                        ({"mesh.data": 2, "mesh.fsdp": 2}, 4)):
        setup = build(small_config("llama", **overrides, **mesh), devices[:count])
        scorer = Scorer.from_setup(setup, 4, jax.device_put(params, setup.shardings.params),
                                   progress=False)
        got = scorer.loglikelihoods(pairs)
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5)
        assert [g[1] for g in got] == [w[1] for w in want], mesh
        assert scorer.generate(prompts, 4) == continuations, mesh


@pytest.mark.slow
def test_a_runs_own_bpe_tokenizer_scores_tasks_in_the_loop_and_from_its_checkpoint(
        tmp_path, devices):
    """A run on a prepared dataset with a trained BPE: the loop scores with the tokenizer
    that made its ids, `task_scorer` with the one stored in the workdir, and lm_eval's
    log-likelihoods are the model's on that tokenizer's ids (lm_eval splits context and
    continuation after encoding them together)."""
    from jaxtrain import inference
    from jaxtrain.prepare import pipeline as prepare
    from jaxtrain.tasks import BACKENDS, TaskSpec
    from jaxtrain.tasks.text import run_tokenizer
    from jaxtrain.train.loop import run

    words = ["alpha", "beta", "gamma", "delta", "return", "value", "print", "def", "class"]
    rng = np.random.default_rng(0)
    (tmp_path / "in").mkdir()
    for i in range(40):
        (tmp_path / "in" / f"{i:03d}.txt").write_text(" ".join(rng.choice(words, 80)) + "\n")
    prepare.prepare(prepare.Request.build(inputs=[str(tmp_path / "in")], out=str(tmp_path / "data"),
                                          train_tokenizer=320, eos="no", progress=False, processes=1))
    items = _write_lines(tmp_path / "bpe_items.jsonl", [
        {"question": "def alpha", "choices": ["beta gamma", "return value"], "label": 0},
        {"question": "print", "choices": ["delta", "class alpha beta"], "label": 1}])
    cfg = small_config(**{"data.source": "prepared", "data.path": str(tmp_path / "data"),
                          "model.vocab_size": 384, "steps": 4, "train.global_batch": 8,
                          "eval_batches": 2, "data.val_fraction": 0.2,
                          "eval.tasks": str(items), "eval.tasks_batch": 4})
    run(cfg, tmp_path / "run", devices[:1])
    in_loop = rows_by_step(metrics_rows(tmp_path / "run"))[4]
    tokenizer = run_tokenizer(None, tmp_path / "run")
    assert tokenizer.kind != "bytes"
    tasks = BACKENDS["lm_eval"].load(TaskSpec((str(items),)))
    scorer, loaded = inference.task_scorer(tmp_path / "run", batch=4, devices=devices)
    results = tasks.evaluate(scorer, tokenizer, log_samples=True)
    assert results.scores == {k: v for k, v in in_loop.items() if k.startswith("tasks/")}
    forward = _direct_forward(loaded.setup.graphdef)
    for doc in results.details["samples"]["bpe_items"]:
        for (context, continuation), ((got, _),) in zip(doc["arguments"], doc["resps"]):
            whole = tokenizer.encode(context + continuation)
            split = len(tokenizer.encode(context))
            assert 0 < split < len(whole)
            with jax.set_mesh(loaded.setup.mesh):
                logits = forward(loaded.params, jnp.asarray([whole[:-1]], jnp.int32))[0]
            logprobs = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
            want = sum(float(logprobs[p - 1, whole[p]]) for p in range(split, len(whole)))
            assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_generate_until_is_greedy_jaxtrain_generate(task_run, task_files, devices):
    """Through lm_eval's own entry point, with the model as the Python API documents it."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from jaxtrain import inference
    from jaxtrain.data.tokenizers import ByteTokenizer
    from jaxtrain.sampling import Sampling, make_generate

    lm = inference.task_model(task_run, batch=2, devices=devices)
    results = lm_eval.simple_evaluate(model=lm, tasks=[str(task_files / "gen.yaml")],
                                      task_manager=TaskManager(include_defaults=False),
                                      bootstrap_iters=0, log_samples=True)
    texts = {doc["doc"]["prompt"]: doc["resps"][0][0] for doc in results["samples"]["gen"]}
    loaded = inference.load(task_run, devices=devices[:1])
    first = _cli("generate", f"--workdir={task_run}", f"--prompt={PROMPTS[0]['prompt']}",
                 "--max_new_tokens=12", "--json")
    assert first.returncode == 0, first.stderr[-2000:]
    expected = [json.loads(first.stdout.strip().splitlines()[-1])["generated_ids"]]
    with jax.set_mesh(loaded.setup.mesh):  # the second prompt (another length), in-process
        generate = make_generate(loaded.setup.graphdef, Sampling(12), loaded.setup.spec.rules)
        prompt = jnp.asarray([list(PROMPTS[1]["prompt"].encode())], jnp.int32)
        expected.append(np.asarray(generate(loaded.params, prompt, jax.random.key(0)))[0])
    for item, ids in zip(PROMPTS, expected):
        text = ByteTokenizer().decode(ids)
        assert texts[item["prompt"]] == text.split("\n\n")[0]
        assert texts[item["prompt"]]  # not cut to nothing: the comparison says something


def _png_size(path) -> tuple[int, int]:
    return struct.unpack(">II", pathlib.Path(path).read_bytes()[16:24])


@pytest.mark.slow
def test_task_scores_in_the_loop_reach_every_sink_and_the_report(task_run, task_files,
                                                                  devices, capsys):
    from log_readers import tensorboard_scalars

    from jaxtrain import inference
    from jaxtrain.commands import report
    from jaxtrain.data.tokenizers import ByteTokenizer
    from jaxtrain.tasks import BACKENDS, TaskSpec

    rows = rows_by_step(metrics_rows(task_run))
    keys = (f"tasks/{TASK}/acc", f"tasks/{TASK}/acc_norm", "tasks/roll/word_perplexity",
            "tasks/roll/byte_perplexity", "tasks/roll/bits_per_byte")
    assert [s for s, r in rows.items() if keys[0] in r] == [2, 4, 6]
    assert all("val_loss" in rows[s] for s in (2, 4, 6))
    scalars = tensorboard_scalars(task_run / "tensorboard")
    for key in keys:
        assert scalars[key] == pytest.approx({s: rows[s][key] for s in (2, 4, 6)})
    # Each evaluation saw that step's parameters: the perplexity moves every time.
    perplexities = [rows[s][keys[2]] for s in (2, 4, 6)]
    assert perplexities == sorted(perplexities, reverse=True) and len(set(perplexities)) == 3
    # The loop scored its live parameters: the same scores as the final checkpoint's.
    tasks = BACKENDS["lm_eval"].load(TaskSpec((str(task_files / f"{TASK}.jsonl"),
                                               str(task_files / "roll.yaml"))))
    scorer, _ = inference.task_scorer(task_run, batch=4, devices=devices)
    assert tasks.evaluate(scorer, ByteTokenizer()).scores == {k: rows[6][k] for k in keys}
    saved = json.loads((task_run / "evals" / "eval_tasks-step6.json").read_text())
    assert saved["results"][TASK]["acc,none"] == rows[6][keys[0]]
    report.main(["--workdir", str(task_run)])
    assert f"{TASK}/acc: first" in capsys.readouterr().out
    width, height = _png_size(task_run / "report.png")
    assert height > width  # a fourth row of panels: the task scores


@pytest.mark.slow
def test_eval_command_scores_tasks_on_a_tensor_mesh(task_run, task_files):
    result = _cli("eval", f"--workdir={task_run}", f"--tasks={task_files / f'{TASK}.jsonl'}",
                  "--tensor=2", "--batch=4", "--log_samples", "--bootstrap_iters=0")
    assert result.returncode == 0, result.stderr[-2000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["step"] == 6 and line["mesh"]["tensor"] == 2
    logged = rows_by_step(metrics_rows(task_run))[6]
    assert line["scores"][f"tasks/{TASK}/acc"] == logged[f"tasks/{TASK}/acc"]
    saved = json.loads(pathlib.Path(line["results"]).read_text())
    assert pathlib.Path(line["results"]).parent == task_run / "evals"
    assert len(saved["samples"][TASK]) == len(ITEMS) and saved["jaxtrain"]["step"] == 6
    assert "|acc" in result.stderr  # lm_eval's table
    missing = _cli("eval", f"--workdir={task_run}", f"--tasks={task_files / 'none.yaml'}")
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"jaxtrain: error: --tasks: {task_files / 'none.yaml'}: " \
                                      "no such file"


# --- fast: configuration, registries and the pieces without a model ----------------------

@pytest.mark.parametrize("overrides,message", [
    ({"eval.tasks": "hellaswag", "data.source": "synthetic"},
     "eval.tasks='hellaswag' is invalid: tasks are text and data.source='synthetic' has no "
     "tokenizer"),
    ({"eval.backend": "helm"}, "eval.backend='helm' is invalid: valid values are lm_eval"),
    ({"eval.tasks_every_steps": -1}, "eval.tasks_every_steps=-1 is invalid: must be >= 0"),
])
def test_eval_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(small_config(**overrides), 1, "cpu")


def test_a_new_task_backend_is_one_registry_entry(monkeypatch):
    from jaxtrain import tasks

    cfg = small_config(**{"eval.backend": "native", "eval.tasks": "x"})
    with pytest.raises(ConfigError, match="eval.backend='native' is invalid"):
        validate(cfg, 1, "cpu")
    monkeypatch.setitem(tasks.BACKENDS, "native", tasks.TaskBackend(
        "native", "a stand-in", load=lambda spec: None, module="json", install="-"))
    validate(cfg, 1, "cpu")
    missing = tasks.TaskBackend("gone", "", load=None, module="no_such_module_x",
                                install="pip install it")
    monkeypatch.setitem(tasks.BACKENDS, "gone", missing)
    with pytest.raises(ConfigError, match="needs the no_such_module_x package: pip install"):
        validate(small_config(**{"eval.backend": "gone", "eval.tasks": "x"}), 1, "cpu")


def test_scores_flatten_and_generation_stops():
    from jaxtrain.data.tokenizers import ByteTokenizer
    from jaxtrain.tasks.harness import _cut, _sampling, flat_scores

    results = {"results": {"arc": {"alias": "arc", "acc,none": 0.5, "acc_stderr,none": 0.1,
                                   "exact_match,strict": 1.0, "sample_len": 4,
                                   "word_perplexity,none": 12.0, "bad": "N/A"}}}
    assert flat_scores(results) == {"tasks/arc/acc": 0.5, "tasks/arc/exact_match_strict": 1.0,
                                    "tasks/arc/word_perplexity": 12.0}
    assert _sampling({"until": "\n", "max_gen_toks": 500}, 64) == ((63, 0.0, 0, 1.0), ["\n"])
    assert _sampling({"do_sample": True, "temperature": 0.7, "top_p": 0.9}, 64)[0] == \
        (63, 0.7, 0, 0.9)
    assert _sampling({"temperature": 0.7}, 64)[0][1] == 0.0  # no do_sample: greedy

    class Lm:
        tokens = ByteTokenizer()
        tok_decode = staticmethod(tokens.decode)

    assert _cut(Lm(), list(b"ab\n\ncd.x"), ["\n\n", ".x"]) == "ab"
    assert _cut(Lm(), list(b"abc"), []) == "abc"


def test_a_missing_task_file_stops_the_run_before_it_starts(tmp_path, devices):
    from jaxtrain.errors import DataError
    from jaxtrain.train.loop import run

    cfg = small_config(**{"eval.tasks": str(tmp_path / "none.yaml")})
    with pytest.raises(DataError, match=f"eval.tasks: {tmp_path / 'none.yaml'}: no such file"):
        run(cfg, tmp_path / "run", devices[:1])
    assert not (tmp_path / "run").exists()


def test_the_model_class_is_registered_with_lm_eval():
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    from jaxtrain.tasks.harness import lm_class

    made = lm_class()  # registered when first made, so importing jaxtrain never loads lm_eval
    assert get_model("jaxtrain") is made and issubclass(made, LM)


def test_scoring_buckets_cover_every_length():
    from jaxtrain.scoring import Scorer

    scorer = Scorer(graphdef=None, mesh=None, rules=(), seq_len=100, batch=4, seq_multiple=8)
    assert [scorer.bucket(n) for n in (1, 16, 17, 33, 64, 65, 100)] == \
        [16, 16, 32, 64, 64, 100, 100]
    assert Scorer(None, None, (), 256, 4, seq_multiple=128).bucket(5) == 128
