"""The generation engine (jaxtrain/engine/): batched ragged greedy decoding equals
transformers' generate per prompt for every family, rows stopping at an EOS id while
others go on; log-probabilities are transformers' log-softmax; continuous batching gives
one-at-a-time's tokens; sampling is reproducible by seed; stops and n samples."""

import functools
import importlib

import jax
import numpy as np
import pytest

from jaxtrain.engine import Engine, Model, Request, SamplingParams
from jaxtrain.engine.steps import MIN_KEYS, bucket, key_bucket
from jaxtrain.errors import ConfigError
from jaxtrain.hf.load import import_hf

PROMPTS = [[5, 17, 42, 7, 99], [3, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [77]]
NEW = 20


def _gpt2():
    import torch
    from test_convert import _config, _hf_model

    cfg = _config("gpt2", **{"model.seq_len": 48})
    model = _hf_model(cfg, seed=2, n_positions=48)
    with torch.no_grad():  # wider weights: else greedy GPT-2 repeats one token
        for name, p in model.named_parameters():
            if "ln_" not in name:
                p.mul_(2.0)
    return cfg, model


# The other families, each from its convert test: (the test module, its tiny-config and
# transformers-model functions, the config function's arguments).
CONVERTED = {"llama": ("test_convert", "_config", "_hf_model", "llama"),
             "qwen3": ("test_convert_llama_like", "_config", "_hf_model", "qwen3"),
             "gemma3": ("test_convert_gemma", "_config", "_hf_model", "gemma3"),
             "mixtral": ("test_convert", "_mixtral_config", "_hf_mixtral"),
             "gpt_oss": ("test_convert_gpt_oss", "_config", "_hf_model"),
             "deepseek_v3": ("test_convert_deepseek_v3", "_config", "_hf_model", "deepseek_v3"),
             "qwen3_5_text": ("test_convert_qwen3_5", "_config", "_hf_model")}


def _converted(module: str, config: str, hf_model: str, *args):
    """(that convert test's tiny config, 48 positions long, its transformers model, seed 2)."""
    test = importlib.import_module(module)
    cfg = getattr(test, config)(*args, **{"model.seq_len": 48})
    return cfg, getattr(test, hf_model)(cfg, seed=2)


FAMILIES = {"gpt2": _gpt2, **{family: functools.partial(_converted, *where)
                              for family, where in CONVERTED.items()}}
FAST = ("llama",)  # the others ~10-50 s each on a 2-core CPU: the slow tier


def _imported(family, tmp_path, devices, **overrides):
    """(transformers model, engine Model) of a family's tiny random model, imported."""
    cfg, hf = FAMILIES[family]()
    hf.save_pretrained(tmp_path / "hf")
    cfg.train.global_batch = 1
    for key, value in overrides.items():
        cfg.update_from_flattened_dict({key: value})
    setup, state = import_hf(cfg, tmp_path / "hf", tmp_path / "run", devices)
    return hf, Model(setup.graphdef, state.params, setup.mesh, setup.spec.rules,
                     setup.spec.vocab_size, setup.spec.seq_len)


def _transformers(hf, prompt, new: int = NEW):
    """(greedy new ids, the raw logits of each step [new, V]) of transformers' generate."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                          output_logits=True)
    logits = torch.stack(out.logits, 1)[0].float()
    return out.sequences[0, len(prompt):].tolist(), logits.log_softmax(-1).numpy()


def _eos_for(wants):
    """An id that ends the first row early (at its 4th token or later) while another row
    never meets it: some rows stop at EOS while others go on."""
    for token in wants[0][3:]:
        if any(token not in w for w in wants[1:]):
            return token
    pytest.fail("no token ends one row but not another")


def _cut(ids, eos):
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def _assert_family_decodes_like_transformers(family, tmp_path, devices):
    hf, model = _imported(family, tmp_path, devices[:1])
    wants = [_transformers(hf, p) for p in PROMPTS]
    eos = _eos_for([w for w, _ in wants])
    engine = Engine(model, slots=4, max_len=48, eos_ids=[eos])
    params = SamplingParams(max_new_tokens=NEW, logprobs=True)
    got = [c for (c,) in engine.generate([Request(tuple(p), params) for p in PROMPTS])]
    for (want, logprobs_NV), c in zip(wants, got):
        assert c.ids == _cut(want, eos), family
        assert c.finish_reason == ("stop" if eos in want else "length")
        picked = logprobs_NV[np.arange(len(c.ids)), c.ids]
        np.testing.assert_allclose(c.logprobs, picked, atol=1e-5, rtol=0)
    assert {c.finish_reason for c in got} == {"stop", "length"}
    assert max(len(set(c.ids)) for c in got) > 2  # not one token repeated


@pytest.mark.parametrize("family", FAST)
def test_ragged_batch_decodes_like_transformers(family, tmp_path, devices):
    _assert_family_decodes_like_transformers(family, tmp_path, devices)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in FAST])
def test_every_family_decodes_like_transformers(family, tmp_path, devices):
    """GPT-2 (learned positions), Qwen3 (q/k norms), Gemma 3 (soft-capped logits, sandwich
    norms), Mixtral (MoE), gpt-oss (sliding windows past 8 positions, sinks, MoE),
    DeepSeek-V3 (MLA's latent cache, a dense prefix, routed and shared experts)."""
    _assert_family_decodes_like_transformers(family, tmp_path, devices)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, devices):
    return _imported("llama", tmp_path_factory.mktemp("llama"), devices[:1])[1]


def _requests(**kw):
    return [Request(tuple(p), SamplingParams(max_new_tokens=12, **kw)) for p in
            PROMPTS + [[9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9]]]


def test_continuous_batching_equals_one_at_a_time(llama):
    """6 requests through 2 slots (slots freed and retaken) give each request's tokens of
    the same engine fed one request at a time."""
    engine = Engine(llama, slots=2, max_len=48)
    together = [c[0].ids for c in engine.generate(_requests())]
    alone = [engine.generate([r])[0][0].ids for r in _requests()]
    assert together == alone
    assert engine.idle()


def test_sampling_is_reproducible_by_seed_and_n_samples_differ(llama):
    engine = Engine(llama, slots=4, max_len=48, top_n=3)
    params = dict(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.95, min_p=0.01,
                  top_logprobs=3)
    request = Request((5, 17, 42), SamplingParams(n=3, seed=7, **params))
    first = engine.generate([request])[0]
    # Alone, or beside other requests: the same draws.
    again = engine.generate([Request((3, 8), SamplingParams(seed=1, **params)), request])[1]
    assert [c.ids for c in first] == [c.ids for c in again]
    assert len({tuple(c.ids) for c in first}) > 1  # the n samples draw differently
    other = engine.generate([Request((5, 17, 42), SamplingParams(n=3, seed=8, **params))])[0]
    assert [c.ids for c in other] != [c.ids for c in first]
    for c in first:
        assert len(c.logprobs) == len(c.top_logprobs) == len(c.ids)
        for lp, top in zip(c.logprobs, c.top_logprobs):
            assert len(top) == 3 and top[0][1] >= lp - 1e-6
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


class _Digits:
    """A tokenizer of ids 0..99 as two-digit text, so stop strings can be tested."""
    vocab_size = 256

    def decode(self, ids):
        return "".join(f"{i:02d}" for i in ids)


def test_stop_strings_cut_the_text(llama):
    engine = Engine(llama, slots=2, max_len=48, tokenizer=_Digits())
    (free,) = engine.generate([Request((5, 17, 42), SamplingParams(max_new_tokens=8))])[0:1]
    text = free[0].text
    stop = text[5:8]  # ends inside the third token
    (cut,) = engine.generate([Request((5, 17, 42), SamplingParams(max_new_tokens=8,
                                                                  stop=(stop,)))])[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.find(stop)]
    assert cut.ids == free[0].ids[:len(cut.ids)] and len(cut.ids) < 8


def test_task_generation_stops_at_its_stop_strings(llama):
    """Scorer.generate (lm-eval's generate_until) ends a continuation at its stop string
    as it decodes, not after max_new_tokens."""
    from jaxtrain.scoring import Scorer

    scorer = Scorer(llama.graphdef, llama.mesh, llama.rules, llama.seq_len, 2,
                    params=llama.params, progress=False, vocab_size=llama.vocab_size)
    (full,) = scorer.generate([[5, 17, 42]], 10)
    stop = _Digits().decode(full)[4:6]  # the third token's text
    (cut,) = scorer.generate([[5, 17, 42]], 10, stop=[stop], tokenizer=_Digits())
    assert len(full) == 10 and cut == full[:len(cut)] and len(cut) <= 3


def test_a_cancelled_request_frees_its_slot(llama):
    engine = Engine(llama, slots=1, max_len=48)
    heard = []
    listener = lambda c, delta, done: heard.append(done)  # noqa: E731
    engine.submit(Request((5, 17), SamplingParams(max_new_tokens=20)), listener)
    waiting = engine.submit(Request((3, 8), SamplingParams(max_new_tokens=3)))
    engine.step()
    engine.cancel(listener)
    while not engine.idle():
        engine.step()
    assert heard == [False] and len(waiting[0].ids) == 3


def test_bad_requests_are_one_line_errors(llama):
    engine = Engine(llama, slots=2, max_len=48)
    cases = [((), {}, "prompt"), ((300,), {}, "prompt"), ((1,) * 48, {}, "no room"),
             ((1, 2), {"max_new_tokens": 47}, "max_new_tokens=47"),
             ((1,), {"top_p": 0.0}, "top_p"), ((1,), {"n": 3}, "n=3"),
             ((1,), {"stop": ("x",)}, "tokenizer"), ((1,), {"top_logprobs": 2}, "top_logprobs")]
    for prompt, kw, match in cases:
        with pytest.raises(ConfigError, match=match) as e:
            engine.submit(Request(prompt, SamplingParams(**kw)))
        assert "\n" not in str(e.value)


def test_buckets_are_few():
    assert [bucket(n, 48) for n in (1, 7, 8, 9, 17, 33, 47)] == [8, 8, 8, 16, 32, 48, 48]
    # A step's cache reads: at least MIN_KEYS, then powers of two, then the whole cache.
    assert [key_bucket(n, 320) for n in (1, 128, 129, 256, 257, 320)] == \
        [128, 128, 256, 256, 320, 320]
    assert key_bucket(1, 48) == 48 and MIN_KEYS == 128


def test_a_step_reads_the_cache_only_as_far_as_its_rows_need(tmp_path, devices):
    """A cache of 320 positions: a row decoding from position 99 to 279 runs steps that
    read 128, then 256, then all 320 positions (key_bucket: three compiled steps), and its
    greedy tokens and log-probabilities are transformers' all the way; a short row beside
    it is unchanged by the longer one's buckets."""
    test = importlib.import_module("test_convert")
    cfg = test._config("llama", **{"model.seq_len": 320})
    FAMILIES["long_llama"] = lambda: (cfg, test._hf_model(cfg, seed=2))
    try:
        hf, model = _imported("long_llama", tmp_path, devices[:1])
    finally:
        del FAMILIES["long_llama"]
    prompt = np.random.default_rng(0).integers(1, cfg.model.vocab_size, 100).tolist()
    want, logprobs_NV = _transformers(hf, prompt, new=180)
    short_want, _ = _transformers(hf, PROMPTS[0])
    engine = Engine(model, slots=2, max_len=320)
    got, short = [c for (c,) in engine.generate([
        Request(tuple(prompt), SamplingParams(max_new_tokens=180, logprobs=True)),
        Request(tuple(PROMPTS[0]), SamplingParams(max_new_tokens=NEW))])]
    assert got.ids == want and short.ids == short_want
    picked = logprobs_NV[np.arange(len(got.ids)), got.ids]
    np.testing.assert_allclose(got.logprobs, picked, atol=1e-5, rtol=0)
    assert engine.steps.step._cache_size() == 3  # the steps of 128, 256 and 320 positions


@pytest.mark.slow
def test_a_tensor_parallel_mesh_decodes_the_same(tmp_path, devices):
    """Over tensor=2 (kv heads split, the cache sharded like them): one device's tokens."""
    _, one = _imported("llama", tmp_path / "one", devices[:1])
    _, two = _imported("llama", tmp_path / "two", devices[:2], **{"mesh.tensor": 2})
    want = [c[0].ids for c in Engine(one, slots=2, max_len=48).generate(_requests())]
    engine = Engine(two, slots=2, max_len=48)
    assert [c[0].ids for c in engine.generate(_requests())] == want
    k_cache = jax.tree.leaves(engine.cache)[0]
    assert len(k_cache.sharding.device_set) == 2


# --- the CLI: generate --chat / --prompts on a run with a tokenizer and a chat template ----

SPECIAL = ["<|im_start|>", "<|im_end|>"]


def chat_run(directory, devices):
    """A tiny random Llama imported with a byte-level BPE whose EOS is <|im_end|>, the
    shipped ChatML template beside it, and a generation_config.json naming EOS id 7 too:
    (workdir, transformers' tokenizer of it)."""
    import json

    import transformers
    from test_convert import _config, _hf_model

    from jaxtrain.prepare import bpe, chat_template

    texts = ["Hello there, how are you? I am fine. Name a colour: blue, red."] * 20
    tokenizer = bpe.train_bpe(texts, 300)
    tokenizer.backend.add_special_tokens(SPECIAL)
    hf_dir = directory / "hf"
    cfg = _config("llama", **{"model.seq_len": 64, "model.vocab_size": 320,
                              "train.global_batch": 1})
    _hf_model(cfg, seed=2).save_pretrained(hf_dir)
    tokenizer.backend.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}))
    workdir = directory / "run"
    import_hf(cfg, hf_dir, workdir, devices[:1])
    (workdir / "tokenizer" / chat_template.TEMPLATE_FILE).write_text(
        (chat_template.SHIPPED / "chatml.jinja").read_text())
    (workdir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    return workdir, transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))


@pytest.fixture(scope="module")
def chat(tmp_path_factory, devices):
    return chat_run(tmp_path_factory.mktemp("chat"), devices)


def _cli(*args):
    import pathlib
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "jaxtrain", "generate", *args],
                          cwd=pathlib.Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)


def test_eos_ids_are_the_runs_and_the_tokenizers(chat):
    from jaxtrain.data import record
    from jaxtrain.engine import run_io

    workdir, theirs = chat
    tokenizer = record.run_tokenizer(workdir, None)
    assert run_io.eos_ids(workdir, tokenizer) == (7, theirs.convert_tokens_to_ids("<|im_end|>"))


@pytest.mark.slow  # a subprocess: jax's import and the compiles
def test_generate_chat_prints_the_reply_and_prompts_write_jsonl(chat, tmp_path):
    import json

    workdir, theirs = chat
    messages = [{"role": "user", "content": "Hello there"}]
    result = _cli(f"--workdir={workdir}", "--chat=Hello there", "--max_new_tokens=12",
                  "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      chat_template=(workdir / "tokenizer" /
                                                     "chat_template.jinja").read_text())
    assert out["prompt_ids"] == list(want.get("input_ids", want))
    ids = out["generated_ids"]
    eos = {7, theirs.convert_tokens_to_ids("<|im_end|>")}
    assert out["finish_reason"] == ("stop" if ids[-1] in eos else "length")
    assert out["text"] == theirs.decode(ids[:-1] if ids[-1] in eos else ids)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"messages": messages}, {"prompt": "Name a colour:", "n": 2, "temperature": 1.0,
                                 "seed": 3}, {"prompt_ids": [5, 6, 8], "max_new_tokens": 3}]))
    result = _cli(f"--workdir={workdir}", f"--prompts={prompts}", "--max_new_tokens=12",
                  f"--output={tmp_path / 'out.jsonl'}", "--logprobs")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample"]) for r in rows] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert rows[0]["ids"] == ids  # the chat row is the --chat prompt, greedy
    assert len(rows[3]["ids"]) <= 3 and len(rows[3]["logprobs"]) == len(rows[3]["ids"])
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    bad = _cli(f"--workdir={workdir}", "--prompt=x", "--top_p=2")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr


@pytest.mark.parametrize("which", ["llama", "deepseek_v3", "gpt_oss"])
def test_the_planner_knows_a_slots_cache(which, devices):
    """plan/decode.py's bytes a slot equal the engine's cache (GQA, MLA's latent, a
    windowed pattern), and a tensor=2 mesh halves a GQA slot's share per device."""
    from flax import nnx

    from jaxtrain import hardware
    from jaxtrain.config import validate
    from jaxtrain.plan.decode import decode_plan
    from jaxtrain.train.setup import build

    if which == "llama":
        from test_convert import _config
        cfg = _config("llama", **{"model.seq_len": 48})
    elif which == "deepseek_v3":
        from test_convert_deepseek_v3 import _config
        cfg = _config("deepseek_v3", **{"model.seq_len": 48})
    else:
        from test_convert_gpt_oss import _config
        cfg = _config(**{"model.seq_len": 48})
    setup = build(cfg, devices[:1])
    with jax.set_mesh(setup.mesh):
        cache = jax.eval_shape(lambda p: nnx.merge(setup.graphdef, p).init_cache(4, 48),
                               setup.abstract_state().params)
    hw = hardware.get("H100-SXM")
    plan = decode_plan(cfg, validate(cfg, 1), hw, 80e9)
    assert plan["cache_bytes_per_slot"] * 4 == sum(x.size * x.dtype.itemsize
                                                   for x in jax.tree.leaves(cache))
    assert plan["slots_that_fit"] > 1000
    if which == "gpt_oss":  # half its layers see 8 keys
        assert plan["window_cache_bytes_per_slot"] == plan["cache_bytes_per_slot"] * (8 + 48) / 96
    if which == "llama":
        cfg.mesh.tensor = 2
        two = decode_plan(cfg, validate(cfg, 2), hw, 80e9)
        assert two["cache_bytes_per_slot_per_device"] == plan["cache_bytes_per_slot"] / 2
