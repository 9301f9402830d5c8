"""Using a trained model: KV-cache decoding, generation, evaluation and int8 quantization."""

import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from flax import nnx
from helpers import assert_cached_decoding_matches_full_forward

from jaxtrain.config import load_config_file
from jaxtrain.data.tokenizers import ByteTokenizer
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.sampling import Sampling, make_generate, pick
from jaxtrain.train.setup import build

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _model(family: str, devices, tensor: int, **overrides):
    # A larger init spreads the logits, so greedy picks are not decided by float noise.
    cfg = small_config(family, **{"mesh.tensor": tensor, "train.global_batch": 1,
                                  "model.init_std": 0.3, **overrides})
    setup = build(cfg, devices[:tensor])
    return setup, setup.init_state().params


CASES = [("gpt2", 1, {}), ("llama", 1, {"model.sliding_window": 8}), ("llama", 4, {})]


@pytest.mark.parametrize("family,tensor,overrides", CASES)
def test_cached_decoding_gives_the_full_forward_logits(family, tensor, overrides, devices):
    setup, params = _model(family, devices, tensor, **overrides)
    assert_cached_decoding_matches_full_forward(setup, params)


@pytest.mark.parametrize("family,tensor", [("gpt2", 1), ("llama", 4)])
def test_greedy_generation_equals_recomputing_the_sequence(family, tensor, devices):
    setup, params = _model(family, devices, tensor)
    prompt = jnp.asarray([[5, 17, 42, 7]], jnp.int32)
    with jax.set_mesh(setup.mesh):
        generate = make_generate(setup.graphdef, Sampling(max_new_tokens=12), setup.spec.rules)
        got = np.asarray(generate(params, prompt, jax.random.key(0)))[0]
        # Recompute: the whole sequence so far through the model for every new token (in a
        # fixed-size buffer, so one compile: position p's logits ignore what comes later).
        forward = jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))
        seq = np.zeros((1, 16), np.int32)
        seq[:, :4] = prompt
        for pos in range(4, 16):
            seq[0, pos] = int(jnp.argmax(forward(params, jnp.asarray(seq))[0, pos - 1]))
        sampled = [np.asarray(make_generate(
            setup.graphdef, Sampling(max_new_tokens=12, temperature=1.0), setup.spec.rules)(
                params, prompt, jax.random.key(seed)))[0] for seed in (0, 0, 1)]
    np.testing.assert_array_equal(got, seq[0, 4:])
    assert len(set(got.tolist())) > 1  # not a degenerate repeat of one token
    np.testing.assert_array_equal(sampled[0], sampled[1])  # a seed fixes the sample
    assert not np.array_equal(sampled[0], sampled[2])


def test_sampling_filters_and_seeds():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = [jax.random.key(i) for i in range(200)]
    draws = lambda s: {int(pick(logits, k, s)[0]) for k in keys}  # noqa: E731
    assert draws(Sampling(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(Sampling(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 + 0.3 covers 0.7
    assert draws(Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(Sampling(temperature=0.0)) == {0}
    with pytest.raises(ValueError, match="--top_p=1.5 is invalid"):
        Sampling(top_p=1.5).check()


def _cli(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain", module, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, devices):
    """configs/tiny.py trained 20 steps of 16 rows on the built-in corpus (a 50th of the main
    job; its validation loss is already under 3.0, from 5.2)."""
    from jaxtrain.train.loop import run

    workdir = tmp_path_factory.mktemp("tiny")
    cfg = load_config_file(ROOT / "configs/tiny.py")
    cfg.steps, cfg.eval_every_steps, cfg.log_every_steps = 20, 20, 10
    cfg.train.global_batch = 16
    run(cfg, workdir, devices[:1])
    return workdir


@pytest.mark.slow
def test_eval_reports_the_runs_validation_loss(tiny_run):
    logged = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    val_loss = [row["val_loss"] for row in logged if "val_loss" in row][-1]
    result = _json(_cli("eval", f"--workdir={tiny_run}"))
    assert result["step"] == 20
    assert result["loss"] == pytest.approx(val_loss, rel=1e-6)
    assert result["perplexity"] == pytest.approx(np.exp(val_loss), rel=1e-6)
    assert result["bits_per_byte"] == pytest.approx(val_loss / np.log(2), rel=1e-6)
    assert val_loss < 3.0  # it learned something: 5.5 at the start


def _logged_val_loss(workdir) -> float:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [row["val_loss"] for row in rows if "val_loss" in row][-1]


@pytest.mark.slow
@pytest.mark.parametrize("activations", [False, True])
def test_int8_model_is_smaller_with_the_same_loss(tiny_run, tmp_path, activations, devices):
    from jaxtrain import inference

    out = tmp_path / "int8"
    flags = ["--int8_activations", "--calibration_batches=4"] if activations else []
    summary = _json(_cli("quantize", f"--workdir={tiny_run}", f"--out={out}", *flags))
    float_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        build(load_config_file(ROOT / "configs/tiny.py"), devices[:1])
        .abstract_state().params))
    on_disk = sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file())
    assert on_disk <= 0.3 * float_bytes, (on_disk, float_bytes)
    assert summary["int8_activations"] is activations
    float_loss = _logged_val_loss(tiny_run)
    assert summary["float32_val_loss"] == pytest.approx(float_loss, rel=1e-6)
    # The saved model, read back as eval and generate read it.
    loaded = inference.load(out, devices=devices)
    _, windows, _ = inference.evaluation_windows(loaded.cfg, None)
    int8_loss = inference.evaluate(loaded, windows, loaded.cfg.eval_batches)["loss"]
    assert int8_loss == pytest.approx(summary["int8_val_loss"], rel=1e-6)
    assert abs(int8_loss / float_loss - 1) < 0.01
    assert int8_loss != float_loss  # the int8 weights are really in use
    if not activations:
        generated = _json(_cli("generate", f"--workdir={out}", "--prompt=def ",
                               "--max_new_tokens=16", "--ignore_eos", "--json"))
        assert generated["prompt_ids"] == list(b"def ")
        assert len(generated["generated_ids"]) == 16


def test_prompts_are_checked(devices):
    from jaxtrain.inference import prompt_tokens

    cfg = small_config()
    assert prompt_tokens(cfg, "hé", None, tokenizer=ByteTokenizer()) == [104, 195, 169]
    assert prompt_tokens(cfg, None, ["1", "2"]) == [1, 2]
    for text, ids, message in [(None, ["1", "300"], "token ids in [0, 256)"),
                               ("x", ["1"], "give exactly one of --prompt and --prompt_ids"),
                               (None, ["a"], "--prompt_ids=a is invalid")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            prompt_tokens(cfg, text, ids)
    cfg.data.source = "bin"
    with pytest.raises(ValueError, match="pass --prompt_ids"):
        prompt_tokens(cfg, "x", None)


def test_ids_always_work_and_text_needs_a_tokenizer_that_covers_them():
    from jaxtrain.inference import decode_text, prompt_tokens
    from jaxtrain.prepare.bpe import train_bpe

    cfg = small_config(**{"model.vocab_size": 512})  # the byte corpus, a 512-id model
    assert prompt_tokens(cfg, None, ["300", "511"]) == [300, 511]
    with pytest.raises(ConfigError, match="--prompt needs the model's tokenizer, and this "
                                          "run has none"):
        prompt_tokens(cfg, "x", None)  # bytes are not assumed for a run without a tokenizer
    assert decode_text(ByteTokenizer(), [104, 105]) == ("hi", None)
    assert decode_text(None, [300]) == (None, None)  # no tokenizer: ids, as documented
    text, why = decode_text(ByteTokenizer(), [104, 300])
    assert text is None and why == ("id 300 is outside the run's tokenizer (bytes (UTF-8, "
                                    "256 ids)): ids only, no text")
    bpe = train_bpe(["alpha beta gamma"] * 4, 300)  # tokenizers' decode drops unknown ids
    assert decode_text(bpe, [70, bpe.vocab_size])[0] is None


def test_bits_per_byte_need_a_tokenizer_that_covers_the_ids(tmp_path):
    from jaxtrain.commands.eval import target_bytes
    from jaxtrain.data.sources import TokenWindows
    from jaxtrain.inference import evaluation_windows
    from jaxtrain.prepare.bpe import train_bpe

    windows = TokenWindows(np.asarray([104, 105, 33, 300, 10]), 2, "ids")
    assert target_bytes(ByteTokenizer(), windows, 1) == 2
    assert target_bytes(ByteTokenizer(), windows, 2) is None  # 300: not a byte
    cfg = small_config(**{"model.vocab_size": 512, "model.seq_len": 4})
    (tmp_path / "a.txt").write_text("some text to evaluate on")
    with pytest.raises(DataError, match="is text and this run has no tokenizer"):
        evaluation_windows(cfg, str(tmp_path / "a.txt"), None)
    _, _, tokenizer = evaluation_windows(cfg, None, None)  # the byte corpus: bytes
    assert tokenizer.kind == "bytes"
    bpe = train_bpe(["a b c"] * 4, 300)
    with pytest.raises(DataError, match=r"the validation split's ids are bytes \(UTF-8, 256 "
                                        r"ids\) \(data.source='stdlib'\), but the run's"):
        evaluation_windows(cfg, None, bpe)


@pytest.mark.slow
def test_generate_cli_error_is_one_line(tiny_run):
    result = _cli("generate", f"--workdir={tiny_run}", "--prompt=x", "--max_new_tokens=200")
    assert result.returncode != 0
    assert "--max_new_tokens=200 is too many" in result.stderr
    assert result.stderr.strip().count("\n") == 0
