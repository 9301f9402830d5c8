"""The tokenizer travels with the run: generate, eval and Hugging Face export/import use it."""

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import small_config

from jaxtrain.data import record
from jaxtrain.data.dataset import PreparedDataset
from jaxtrain.errors import DataError
from jaxtrain.prepare import pipeline as P

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta", "gamma", "delta", "return", "value", "print", "def", "class"]


def _cli(module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"jaxtrain.commands.{module}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, devices):
    """A small GPT trained 10 steps on a prepared dataset with a trained BPE (no EOS, ASCII)."""
    from jaxtrain.train.loop import run

    tmp = tmp_path_factory.mktemp("bpe_run")
    rng = np.random.default_rng(0)
    (tmp / "in").mkdir()
    for i in range(60):
        (tmp / "in" / f"{i:03d}.txt").write_text(" ".join(rng.choice(WORDS, 80)) + "\n")
    P.prepare(P.Request.build(inputs=[str(tmp / "in")], out=str(tmp / "data"), train_tokenizer=320,
                              eos="no", progress=False, processes=1))
    cfg = small_config(**{"data.source": "prepared", "data.path": str(tmp / "data"),
                          "model.vocab_size": 384, "steps": 10, "eval_every_steps": 10,
                          "train.global_batch": 8, "eval_batches": 2,
                          "data.val_fraction": 0.2})
    run(cfg, tmp / "run", devices[:1])
    return tmp / "run", PreparedDataset(tmp / "data").tokenizer()


@pytest.mark.slow
def test_generate_encodes_and_decodes_with_the_runs_tokenizer(bpe_run):
    workdir, tokenizer = bpe_run
    assert record.run_tokenizer(workdir, None).fingerprint() == tokenizer.fingerprint()
    result = _json(_cli("generate", f"--workdir={workdir}", "--prompt=def alpha",
                        "--max_new_tokens=6", "--ignore_eos", "--json"))
    assert result["prompt_ids"] == tokenizer.encode("def alpha")
    assert len(result["generated_ids"]) == 6
    assert result["text"] == tokenizer.decode(result["prompt_ids"] + result["generated_ids"])
    assert result["text"].startswith("def alpha")


@pytest.mark.slow
def test_eval_bits_per_byte_come_from_real_byte_counts(bpe_run):
    from jaxtrain import inference

    workdir, tokenizer = bpe_run
    result = _json(_cli("eval", f"--workdir={workdir}"))
    _, cfg = inference.run_config(workdir)
    _, windows, _ = inference.evaluation_windows(cfg, None)
    count = cfg.eval_batches * cfg.train.global_batch
    text_bytes = sum(len(tokenizer.decode(windows[i][1:]).encode()) for i in range(count))
    assert result["bytes"] == text_bytes
    assert result["bits_per_byte"] == pytest.approx(
        result["loss"] * result["tokens"] / math.log(2) / text_bytes, rel=1e-9)
    assert result["bits_per_byte"] < result["bits_per_token"] / 2  # tokens are several bytes


@pytest.mark.slow
def test_hugging_face_export_and_import_carry_the_tokenizer(bpe_run, tmp_path, devices):
    from transformers import AutoTokenizer

    workdir, tokenizer = bpe_run
    out = tmp_path / "hf"
    result = _cli("convert", "--to-hf", str(out), f"--workdir={workdir}")
    assert result.returncode == 0, result.stderr[-2000:]
    auto = AutoTokenizer.from_pretrained(str(out))
    for text in ["def alpha(beta): return gamma", "print value delta class"]:
        assert auto(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    # Importing that directory makes its tokenizer the new run's...
    config = tmp_path / "cfg.py"
    config.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                      "from conftest import small_config\n\n\ndef get_config():\n"
                      "    return small_config(**{'model.vocab_size': 384, 'mesh.data': -1})\n")
    imported = tmp_path / "imported"
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    hf_config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**hf_config,
                                                           "chat_template": template}))
    result = _cli("convert", "--from-hf", str(out), f"--config={config}",
                  f"--workdir={imported}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert record.run_tokenizer(imported, None).fingerprint() == tokenizer.fingerprint()
    # ... with the model's chat template, which generate --chat and serve render.
    assert (imported / "tokenizer" / "chat_template.jinja").read_text() == template
    from jaxtrain.engine import run_io
    rendered = run_io.chat_template(imported, record.run_tokenizer(imported, None))
    assert rendered.render([{"role": "user", "content": "hi"}],
                           add_generation_prompt=True) == "<user>hi<assistant>"
    # ... and fine-tuning it on data of another tokenizer (the byte corpus) is refused.
    cfg = small_config(**{"model.vocab_size": 384})
    with pytest.raises(DataError, match=r"the data was made with tokenizer bytes \(UTF-8, 256 "
                                        r"ids\), but this run started with huggingface"):
        record.check_and_store(imported, *record.run_data(cfg), True, False, True)
