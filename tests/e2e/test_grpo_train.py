"""train.objective=grpo end to end (issue #49): a prompt set sampled with the engine on the
parameters being trained, rewarded, and stepped with the GRPO loss; through the CLI, a
kill -9 and a rerun bitwise the uninterrupted run, a mesh equal to one device, a reward
function that raises refused in one line with the last checkpoint standing, one-line
config errors before anything compiles."""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import small_config

from jaxtrain.checkpoint import Checkpoints
from jaxtrain.commands import prepare as prepare_cmd
from jaxtrain.config import apply_overrides, load_config_file, validate
from jaxtrain.data.prompt_set import load
from jaxtrain.errors import ConfigError
from jaxtrain.rl.objective import Rollouts, shard_rollouts
from jaxtrain.train.setup import build
from jaxtrain.xla_flags import with_device_count

ROOT = pathlib.Path(__file__).resolve().parents[2]
RAW_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# A tiny model on arithmetic prompts: 2 prompts x 4 samples of 8 new tokens a step.
GRPO = {"train.objective": "grpo", "data.source": "prompts", "model.d_model": 64,
        "model.num_layers": 2, "model.seq_len": 32, "train.global_batch": 8,
        "train.grpo.num_generations": 4, "train.grpo.max_completion_length": 8,
        "train.grpo.rewards": "grpo_rewards:digits", "log_every_steps": 1,
        "optimizer.lr": 3e-3, "optimizer.warmup_steps": 1}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """A prompt set of 40 sums 'a+b=' with their answers, rendered as the bare text."""
    directory = tmp_path_factory.mktemp("prompts")
    rng = np.random.default_rng(0)
    pairs = rng.integers(0, 20, (40, 2))  # prompts of 4 to 6 tokens: left padding
    (directory / "p.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    (directory / "raw.jinja").write_text(RAW_TEMPLATE)
    assert prepare_cmd.main([str(directory / "p.jsonl"), "--prompts", "--out",
                             str(directory / "set"), "--tokenizer", "bytes",
                             "--chat-template", str(directory / "raw.jinja")]) == 0
    return directory / "set"


def _args(prompts, workdir, **overrides) -> list[str]:
    values = {**GRPO, "data.path": str(prompts), **overrides}
    return ["--config", "configs/tiny.py", f"--workdir={workdir}",
            *(f"--config.{k}={v}" for k, v in values.items())]


def _env(**more) -> dict:
    return dict(os.environ, XLA_FLAGS=with_device_count(1),
                PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", **more)


def _cli(prompts, workdir, env=None, **overrides) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxtrain.main",
                           *_args(prompts, workdir, **overrides)], cwd=ROOT,
                          env=env or _env(), capture_output=True, text=True, timeout=600)


def _rows(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _losses(workdir) -> dict:
    return {r["step"]: (r["loss"], r["grad_norm"], r["reward"]) for r in _rows(workdir)
            if "loss" in r}


def test_prompts_of_a_step_are_a_function_of_seed_and_step(prompts):
    data = load(prompts)
    first = [data.step_indices(0, s, 3).tolist() for s in range(30)]
    assert first == [data.step_indices(0, s, 3).tolist() for s in range(30)]
    assert sorted(sum(first[:13], [])[:39]) == sorted(set(sum(first[:13], [])[:39]))  # epoch 0
    assert first != [data.step_indices(1, s, 3).tolist() for s in range(30)]


def test_config_errors_are_one_line_before_anything_compiles(prompts):
    for key, value, says in (
            ("train.grpo.loss_type", "ppo", "valid values are grpo, bnpo"),
            ("train.grpo.rewards", "nosuch:fn", "cannot import it"),
            ("train.grpo.rewards", "answer,format", None),
            ("train.grpo.reward_weights", "1,2,3", "one weight per reward function"),
            ("train.grpo.num_generations", 3, "must divide by train.grpo.num_generations"),
            ("train.grpo.scale_rewards", "all", "valid values are group, batch, none"),
            ("train.grpo.temperature", 0.0, "must be > 0"),
            ("data.source", "stdlib", "train.objective='grpo' samples prompts")):
        overrides = {**GRPO, "data.path": str(prompts), key: value}
        if key == "data.source":
            overrides["data.path"] = ""
        cfg = small_config("gpt2", **overrides)
        if says is None:
            validate(cfg, 1)
            continue
        with pytest.raises(ConfigError, match=says) as e:
            validate(cfg, 1)
        assert key in str(e.value) and "\n" not in str(e.value), str(e.value)
    lm = small_config("gpt2", **{"data.source": "prompts", "data.path": str(prompts)})
    with pytest.raises(ConfigError, match="a prompt set is sampled from"):
        validate(lm, 1)


@pytest.mark.slow
def test_a_grpo_run_through_the_cli_logs_trl_metrics_and_a_raising_reward_stops_it(
        prompts, tmp_path):
    """3 steps through the CLI with TRL's metric names; then a run on to step 5 whose
    reward function raises: exit 2, one line naming the function and a prompt, nothing
    applied (the step-2 checkpoint is the newest and restores)."""
    workdir = tmp_path / "run"
    rewards = "grpo_rewards:digits,grpo_rewards:fails_when_flagged"
    flag = tmp_path / "fail"
    env = _env(GRPO_TEST_FAIL=str(flag))
    done = _cli(prompts, workdir, env, steps=2, **{"train.grpo.rewards": rewards,
                                                   "checkpoint.every_steps": 2})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in _rows(workdir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for name in ("reward", "reward_std", "rewards/digits/mean", "rewards/fails_when_flagged/mean",
                 "completions/mean_length", "completions/max_length",
                 "completions/clipped_ratio", "clip_ratio/region_mean", "entropy",
                 "rollout_tokens_per_s", "time/generate_s", "time/score_s", "grad_norm"):
        assert name in rows[-1], name
    assert rows[-1]["completions/max_length"] <= 8
    assert any(r["grad_norm"] > 0 for r in rows)  # the digit reward varies: a real step
    flag.write_text("")
    failed = _cli(prompts, workdir, env, steps=5, **{"train.grpo.rewards": rewards,
                                                     "checkpoint.every_steps": 2})
    assert failed.returncode == 2, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert "'grpo_rewards:fails_when_flagged' raised ValueError: no reward for this one" \
        in errors[0] and "(prompt 0: '" in errors[0], errors[0]
    checkpoints = Checkpoints(workdir / "checkpoints", keep=3, read_only=True)
    try:
        assert checkpoints.latest_intact()[0] == 2
    finally:
        checkpoints.close()
    assert max(_losses(workdir)) == 2


def _start(prompts, workdir):
    return subprocess.Popen([sys.executable, "-m", "jaxtrain.main",
                             *_args(prompts, workdir, steps=12,
                                    **{"checkpoint.every_steps": 3})],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _final_params(prompts, workdir):
    cfg = apply_overrides(load_config_file(ROOT / "configs" / "tiny.py"),
                          {**GRPO, "data.path": str(prompts)})
    setup = build(cfg, jax.devices()[:1])
    checkpoints = Checkpoints(workdir / "checkpoints", keep=3, read_only=True)
    try:
        tree = checkpoints.restore(12, setup.abstract_state().tree())
    finally:
        checkpoints.close()
    return jax.tree.map(np.asarray, tree["params"])


@pytest.mark.slow
def test_kill_9_then_rerun_is_bitwise_the_uninterrupted_run(prompts, tmp_path):
    """The prompts and the sampling keys are functions of (seed, step) and the samples of
    the state: the rerun samples, scores and steps exactly as the uninterrupted run."""
    whole = _start(prompts, tmp_path / "whole")
    _, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err[-3000:]
    killed = tmp_path / "killed"
    process = _start(prompts, killed)
    deadline = time.time() + 300
    while time.time() < deadline and max(
            _losses(killed) if (killed / "metrics.jsonl").exists() else [], default=0) < 7:
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert max(_losses(killed)) < 12, "killed before the end"
    rerun = _start(prompts, killed)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-3000:]
    assert _losses(killed) == _losses(tmp_path / "whole"), "every step, bit for bit"
    for a, b in zip(jax.tree.leaves(_final_params(prompts, killed)),
                    jax.tree.leaves(_final_params(prompts, tmp_path / "whole"))):
        np.testing.assert_array_equal(a, b)


def _rollouts(rng, rows=8, prompt=6, completion=8, vocab=256) -> Rollouts:
    """Host rollouts of random tokens: prompts of several lengths, completions cut short."""
    ids = rng.integers(1, vocab, (rows, prompt + completion)).astype(np.int32)
    prompt_mask = np.ones((rows, prompt), np.int32)
    prompt_mask[::2, :2] = 0  # left padding
    mask = (np.arange(completion)[None] < rng.integers(2, completion + 1, (rows, 1)))
    mask = mask.astype(np.int32)
    advantages = rng.standard_normal(rows).astype(np.float32)
    return Rollouts(ids, prompt_mask, mask, advantages, np.full(rows, mask.sum(), np.float32))


def _step(devices, prompts, **overrides):
    cfg = small_config("llama", **{**GRPO, "data.path": str(prompts), **overrides})
    setup = build(cfg, devices)
    state = setup.init_state()
    batch = _rollouts(np.random.default_rng(3))
    with jax.set_mesh(setup.mesh):
        _, metrics = setup.train_step()(state, shard_rollouts(batch, setup.tokens_sharding))
    return {k: float(metrics[k]) for k in ("loss", "grad_norm", "entropy", "kl")
            if k in metrics}


@pytest.mark.slow
def test_a_mesh_and_micro_batches_equal_one_device(devices, prompts):
    """data 2 x fsdp 2 x tensor 2, with 2 micro-batches (Rollouts' [B] leaves split like
    its rows), and a KL reference held as a frozen copy: the step of one device."""
    kl = {"train.grpo.beta": 0.1}
    one = _step(devices[:1], prompts, **kl)
    mesh = _step(devices, prompts, **kl, **{"mesh.data": 2, "mesh.fsdp": 2,
                                            "mesh.tensor": 2, "train.microbatches": 2})
    for name in one:
        np.testing.assert_allclose(mesh[name], one[name], rtol=2e-5, atol=1e-7, err_msg=name)
    assert one["grad_norm"] > 0


@pytest.mark.slow
def test_lora_base_as_reference_iterations_and_dynamic_sampling(devices, prompts, tmp_path):
    """LoRA with beta > 0: the frozen base is the KL reference (no copy held), so a fresh
    state's KL is 0; a run with num_iterations=2 (two updates on one generation, old
    log-probs from the step's start: it logs its last update's metrics, the KL after one
    update) and DAPO's dynamic sampling (groups of equal rewards count nothing)."""
    from jaxtrain.metrics_log import read_metrics
    from jaxtrain.train.loop import run

    cfg = small_config("llama", **{**GRPO, "data.path": str(prompts), "steps": 2,
                                   "model.lora.rank": 4, "train.grpo.beta": 0.1,
                                   "train.grpo.num_iterations": 2,
                                   "train.grpo.dynamic_sampling": True,
                                   "train.grpo.rewards": "grpo_rewards:digits,answer",
                                   "optimizer.lr": 1e-2})
    setup = build(cfg, devices[:1])
    assert list(setup.shardings.frozen) == ["base"]  # the base is the reference
    fresh = _step(devices[:1], prompts, **{"model.lora.rank": 4, "train.grpo.beta": 0.1})
    assert abs(fresh["kl"]) < 1e-6 and fresh["grad_norm"] > 0
    run(cfg, tmp_path / "run", devices[:1])
    rows = [r for r in read_metrics(tmp_path / "run", say=lambda _: None) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert 0 < rows[0]["kl"] < 0.1 and rows[-1]["kl"] > 0
    assert 0 < rows[0]["kept_ratio"] <= 1 and rows[0]["grad_norm"] > 0
    assert "rewards/answer/mean" in rows[0] and "rewards/digits/mean" in rows[0]


def test_generate_reads_a_prompt_set_by_its_ids(prompts):
    """generate --prompts takes a prompt set's lines (prompt_ids beside the prompt as given
    and the reward columns) as well as its own one-key lines."""
    from jaxtrain.engine.run_io import read_prompts

    rows = read_prompts(str(prompts / "prompts.jsonl"))
    assert len(rows) == 40 and all({"prompt_ids", "prompt", "answer"} <= set(r) for r in rows)
    assert bytes(rows[0]["prompt_ids"]).decode() == rows[0]["prompt"]


def test_the_planner_counts_a_reference_copy_only_with_beta_and_without_lora(prompts):
    from jaxtrain.plan.memory import estimate

    sizes = {a: 1 for a in ("data", "pipeline", "fsdp", "expert", "context", "tensor")}
    lm = estimate(small_config("llama"), sizes)
    grpo = {**GRPO, "data.path": str(prompts)}
    assert estimate(small_config("llama", **grpo), sizes)["params"] == lm["params"]
    with_kl = estimate(small_config("llama", **grpo, **{"train.grpo.beta": 0.1}), sizes)
    assert with_kl["params"] == 2 * lm["params"]
    lora = {"model.lora.rank": 4}
    assert estimate(small_config("llama", **grpo, **lora, **{"train.grpo.beta": 0.1}),
                    sizes)["params"] == estimate(small_config("llama", **lora), sizes)["params"]


def test_the_step_scores_what_the_engine_sampled(prompts, devices):
    """The loss's log-probabilities of a step's rollouts (left-padded prompts of several
    lengths, segment masks and positions from each row's first token) are the engine's
    own log-probabilities of the tokens it sampled."""
    from jaxtrain.rl.objective import rollout_logps
    from jaxtrain.train import rollouts as rollouts_lib

    cfg = small_config("gpt2", **{**GRPO, "data.path": str(prompts)})
    setup = build(cfg, devices[:1])
    state = setup.init_state()
    rollouter = rollouts_lib.Rollouter(cfg)
    by_length = np.argsort([len(line["prompt_ids"]) for line in rollouter.prompts.lines])
    indices = by_length[[0, -1]]  # the shortest prompt and the longest
    assert len(rollouter.prompts.lines[indices[0]]["prompt_ids"]) < rollouter.width
    requests = [r.__class__(r.prompt_ids, dataclasses.replace(r.params, logprobs=True))
                for r in rollouter._requests(0, indices)]
    engine = rollouter._engine(setup, state.model_params())
    done = [c for cs in engine.generate(requests) for c in cs]
    lines = [rollouter.prompts.lines[i] for i in np.repeat(indices, 4)]
    batch, _ = rollouter._scored(lines, done)
    with jax.set_mesh(setup.mesh):
        logp_BT = np.asarray(jax.jit(rollout_logps, static_argnums=(1, 3))(
            state.model_params(), setup.graphdef, batch, 1.0))
    for completion, row in zip(done, logp_BT):
        np.testing.assert_allclose(row[:len(completion.ids)], completion.logprobs, atol=2e-5)


def _launch(prompts, workdir, processes: int) -> dict:
    """A GRPO job of `processes` local processes (jaxtrain launch, 8 devices in all, data 2
    x fsdp 2 x tensor 2): every process samples the whole batch, each steps its rows."""
    args = _args(prompts, workdir, steps=3, **{"model.num_layers": 2, "mesh.data": 2,
                                               "mesh.fsdp": 2, "mesh.tensor": 2,
                                               "train.global_batch": 16})
    done = subprocess.run([sys.executable, "-m", "jaxtrain.commands.launch", "--processes",
                           str(processes), "--devices-per-process", str(8 // processes),
                           "--", *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(workdir)


@pytest.mark.slow
def test_two_processes_sample_and_train_as_one(prompts, tmp_path):
    one = _launch(prompts, tmp_path / "one", 1)
    two = _launch(prompts, tmp_path / "two", 2)
    assert sorted(two) == [1, 2, 3] and any(grad > 0 for _, grad, _ in two.values())
    for step in (1, 2, 3):
        np.testing.assert_allclose(two[step], one[step], rtol=0, atol=1e-6, err_msg=step)


@pytest.mark.slow  # a subprocess: jax's import
def test_a_bad_grpo_key_is_one_line_and_exit_2_through_the_cli(prompts, tmp_path):
    done = _cli(prompts, tmp_path / "run", **{"train.grpo.loss_type": "ppo"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == ("jaxtrain: error: train.grpo.loss_type='ppo' is invalid: "
                                   "valid values are grpo, bnpo, dr_grpo, dapo, cispo, sapo, "
                                   "luspo"), done.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the workdir is written
