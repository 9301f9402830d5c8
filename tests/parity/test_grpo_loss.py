"""The GRPO family's numeric core (jaxtrain/rl) against TRL 1.16's GRPOTrainer itself.

One GRPOTrainer on a tiny transformers Llama, its generation replaced by a fixed batch
(prompts of one length, completions of several, some ending in EOS), its reward functions
reading fixed columns (None included): TRL's _generate_and_score_completions gives the
advantages and masks, and its _compute_loss the loss, gradients and metrics of each
loss_type on fixed sampling-time and reference log-probabilities. jaxtrain's rewards,
advantages, completion_logps and grpo_loss on the same weights (imported with import_hf)
must give the same numbers within 1e-5."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import small_config

from jaxtrain.rl.advantages import group_advantages, weighted_rewards
from jaxtrain.rl.batch import rollout_advantages, rollout_batch
from jaxtrain.rl.logps import completion_logps, rollout_layout
from jaxtrain.rl.loss import LossSettings, grpo_loss, truncation_mask
from jaxtrain.rl.objective import Rollouts, grpo_objective, rollout_logps, shard_rollouts
from jaxtrain.rl.rewards import Reward, score

SHAPE = {"model.d_model": 32, "model.num_heads": 4, "model.num_kv_heads": 2,
         "model.mlp_dim": 64, "model.vocab_size": 64, "model.norm_eps": 1e-6,
         "model.num_layers": 2, "model.attention": "xla", "model.seq_len": 16,
         "data.source": "synthetic"}
EOS, PAD = 0, 1
GROUPS, GENERATIONS, PROMPT, MAX_COMPLETION = 2, 4, 4, 8
LENGTHS = [7, 3, 5, 7, 2, 6, 7, 4]  # the longest is 7 < MAX_COMPLETION: dr_grpo's constant
ENDS_IN_EOS = [1, 4, 5]
SCORE_A = [1.0, 0.0, 0.5, None, 2.0, None, 1.5, 0.25]
SCORE_B = [0.5, None, 1.0, None, 0.0, 2.0, None, 1.0]  # row 3: unscored by both
WEIGHTS = [1.0, 0.5]
TEMPERATURE = 0.9


def score_a(prompts, completions, a, **kwargs):
    return a


def score_b(prompts, completions, b, **kwargs):
    return b


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": EOS, "<pad>": PAD, **{f"t{i}": i for i in range(2, 64)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                                eos_token="<eos>")


def _rollouts():
    """(prompt ids, completion ids) lists of one fixed batch: GROUPS prompts, each repeated
    GENERATIONS times (TRL's layout), completions of LENGTHS (no EOS inside)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 64, PROMPT).tolist() for _ in range(GROUPS)]
    completions = [rng.integers(2, 64, n).tolist() for n in LENGTHS]
    for i in ENDS_IN_EOS:
        completions[i][-1] = EOS
    return [p for p in prompts for _ in range(GENERATIONS)], completions


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random transformers Llama, saved."""
    pytest.importorskip("torch")
    from test_convert import _hf_model

    path = tmp_path_factory.mktemp("grpo") / "hf"
    _hf_model(small_config("llama", **SHAPE)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sides(hf_dir, devices):
    """(TRL's trainer, jaxtrain's (setup, state)) of the one model."""
    trl = pytest.importorskip("trl")
    from jaxtrain.hf.load import import_hf

    setup, state = import_hf(small_config("llama", **SHAPE), hf_dir, hf_dir.parent / "base",
                             devices[:1])
    return _trl_trainer(trl, hf_dir), setup, state


def _trl_trainer(trl, hf_dir):
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=str(hf_dir.parent / "trl"), per_device_train_batch_size=GROUPS * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, beta=0.0,
        reward_weights=WEIGHTS, temperature=TEMPERATURE, report_to=[], use_cpu=True,
        bf16=False)
    trainer = trl.GRPOTrainer(model=str(hf_dir), reward_funcs=[score_a, score_b],
                              args=args, processing_class=_tokenizer(),
                              train_dataset=Dataset.from_dict({"prompt": ["t2"] * 8}))
    prompts, completions = _rollouts()
    trainer._generate = lambda _: (prompts, completions, None, ["c"] * len(completions),
                                   None, {}, None, None)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def _trl_batch(trainer, scale_rewards="group", mask_truncated=False):
    trainer.scale_rewards, trainer.mask_truncated_completions = scale_rewards, mask_truncated
    trainer.beta = 0.0  # no reference pass here: the tests give reference log-probs
    rows = [{"prompt": "t2", "a": a, "b": b} for a, b in zip(SCORE_A, SCORE_B)]
    return trainer._generate_and_score_completions(rows)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_equal_trl(sides, scale_rewards):
    trainer, _, _ = sides
    theirs = _trl_batch(trainer, scale_rewards)["advantages"].numpy()
    prompts, completions = _rollouts()
    rewards_NF, per_function = score(
        [Reward("score_a", score_a, WEIGHTS[0]), Reward("score_b", score_b, WEIGHTS[1])],
        ["t2"] * 8, ["c"] * 8, completions, {"a": SCORE_A, "b": SCORE_B})
    ours, metrics = group_advantages(weighted_rewards(rewards_NF, WEIGHTS), GENERATIONS,
                                     scale_rewards)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours[3] == 0.0 and np.abs(ours).max() > 0.5  # the unscored row: no signal
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for name, value in {**metrics, **per_function}.items():
        np.testing.assert_allclose(value, logged[name], rtol=1e-5, err_msg=name)


def _inputs(trainer, mask_truncated=False):
    """TRL's batch with fixed sampling-time and reference log-probabilities: the policy's
    own, moved by N(0, 0.3) per token (ratios on both sides of the clip), 0 on padding."""
    import torch

    batch = _trl_batch(trainer, "group", mask_truncated)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, batch["completion_ids"].size(1))
    rng = np.random.default_rng(1)
    mask = batch["completion_mask"].float()
    for name in ("old_per_token_logps", "ref_per_token_logps"):
        noise = torch.from_numpy(rng.normal(0, 0.3, logp.shape).astype(np.float32))
        batch[name] = (logp + noise) * mask
    return batch


CASES = {  # name: (TRL GRPOConfig's settings, mask_truncated_completions)
    "grpo": (dict(loss_type="grpo", beta=0.04, epsilon=0.2, epsilon_high=0.28), False),
    "bnpo": (dict(loss_type="bnpo", beta=0.04, epsilon=0.2, epsilon_high=0.28), False),
    "dr_grpo": (dict(loss_type="dr_grpo", beta=0.04, epsilon=0.2, epsilon_high=0.28), False),
    "dapo": (dict(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28), False),
    "cispo": (dict(loss_type="cispo", beta=0.04, epsilon=0.2, epsilon_high=1.1), False),
    "gspo": (dict(loss_type="grpo", beta=0.04, epsilon=0.05, epsilon_high=0.1,
                  importance_sampling_level="sequence"), False),
    "sapo": (dict(loss_type="sapo", beta=0.04, sapo_temperature_pos=1.0,
                  sapo_temperature_neg=1.5), False),
    "luspo": (dict(loss_type="luspo", beta=0.04, epsilon=0.05, epsilon_high=0.1,
                   importance_sampling_level="sequence"), False),
    "dapo-delta-no-kl": (dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28,
                              delta=1.4), False),
    "bnpo-truncated": (dict(loss_type="bnpo", beta=0.04, epsilon=0.2, epsilon_high=0.28),
                       True),
}


def _trl_loss(trainer, inputs, settings):
    """(loss, gradient norm, metrics) of TRL's _compute_loss under settings."""
    import torch

    trainer.loss_type = settings.loss_type
    trainer.importance_sampling_level = settings.importance_sampling_level
    trainer.beta = settings.beta
    trainer.epsilon_low, trainer.epsilon_high = settings.epsilon, settings.high
    trainer.args.delta = settings.delta
    trainer.args.sapo_temperature_pos = settings.sapo_temperature_pos
    trainer.args.sapo_temperature_neg = settings.sapo_temperature_neg
    trainer._metrics["train"].clear()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in trainer.model.parameters()))
    return float(loss.detach()), float(norm), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(setup, state, inputs, settings):
    ids = np.concatenate([inputs["prompt_ids"].numpy(), inputs["completion_ids"].numpy()], 1)
    mask = inputs["completion_mask"].numpy()
    width = mask.shape[1]
    arrays = [jnp.asarray(inputs[k].numpy()) for k in ("old_per_token_logps",
                                                       "ref_per_token_logps", "advantages")]

    def objective(params):
        logp_BT, entropy_BT, _, _ = completion_logps(params, setup.graphdef, jnp.asarray(ids),
                                                     width, temperature=TEMPERATURE)
        return grpo_loss(logp_BT, arrays[0], arrays[1], jnp.asarray(mask), arrays[2],
                         settings, entropy_BT=entropy_BT)

    with jax.set_mesh(setup.mesh):
        (loss, metrics), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(
            state.params)
    return float(loss), float(optax.tree.norm(grads)), jax.device_get(metrics)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_gradient_and_metrics_equal_trl(sides, case):
    trainer, setup, state = sides
    config, mask_truncated = CASES[case]
    settings = LossSettings(max_completion_length=MAX_COMPLETION, **config)
    inputs = _inputs(trainer, mask_truncated)
    loss, norm, theirs = _trl_loss(trainer, inputs, settings)
    ours_loss, ours_norm, ours = _ours(setup, state, inputs, settings)
    np.testing.assert_allclose(ours_loss, loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours_norm, norm, rtol=1e-5)
    assert set(ours) == set(theirs) - {"policy_loss"}, (set(ours), set(theirs))
    for name, value in theirs.items():
        np.testing.assert_allclose(float(ours[name]), value, rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    assert norm > 1e-3
    clipped = [v for k, v in theirs.items() if k in ("clip_ratio/region_mean",
                                                      "cispo_clip_ratio")]
    # the clip is active on some tokens only (of the 11 left by truncation, by chance none)
    assert mask_truncated or all(0 < v < 1 for v in clipped), theirs


def _rollouts_of(inputs, with_ref=True):
    mask = inputs["completion_mask"].numpy().astype(np.int32)
    ids = np.concatenate([inputs["prompt_ids"].numpy(), inputs["completion_ids"].numpy()], 1)
    ref = inputs["ref_per_token_logps"].numpy() if with_ref else None
    return Rollouts(ids.astype(np.int32), inputs["prompt_mask"].numpy().astype(np.int32),
                    mask, inputs["advantages"].numpy(), np.full(len(mask), mask.sum(),
                                                                np.float32),
                    old_logps=inputs["old_per_token_logps"].numpy(), ref_logps=ref)


@pytest.mark.slow
def test_the_objective_on_a_mesh_with_the_reference_on_the_fly_equals_trl(
        sides, hf_dir, tmp_path, devices):
    """grpo_objective on 8 devices (data 2 x fsdp 2 x tensor 2), the reference's
    log-probs computed from its parameters (here the policy's, as at step 0), against TRL
    given those log-probs: loss, gradient norm and metrics within 1e-5."""
    from jaxtrain.hf.load import import_hf

    trainer, one, one_state = sides
    cfg = small_config("llama", **SHAPE, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    setup, state = import_hf(cfg, hf_dir, tmp_path / "mesh", devices)
    inputs = _inputs(trainer)
    rollouts = _rollouts_of(inputs, with_ref=False)
    with jax.set_mesh(one.mesh):
        ref = jax.jit(rollout_logps, static_argnums=(1, 3))(
            one_state.params, one.graphdef, rollouts, TEMPERATURE)
    inputs["ref_per_token_logps"] = torch_tensor(np.asarray(ref))
    settings = LossSettings(loss_type="dapo", beta=0.04, epsilon_high=0.28)
    loss, norm, theirs = _trl_loss(trainer, inputs, settings)

    def objective(params, batch):
        return grpo_objective(params, setup.graphdef, batch, settings, TEMPERATURE,
                              reference=params, reference_graphdef=setup.graphdef)

    with jax.set_mesh(setup.mesh):
        batch = shard_rollouts(rollouts, setup.tokens_sharding)
        (ours_loss, ours), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(
            state.params, batch)
    np.testing.assert_allclose(float(ours_loss), loss, rtol=1e-5)
    np.testing.assert_allclose(float(optax.tree.norm(grads)), norm, rtol=1e-5)
    for name, value in theirs.items():
        np.testing.assert_allclose(float(ours[name]), value, rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    assert theirs["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy


def test_on_policy_rollouts_without_old_logps_equal_trl(sides):
    """old_logps None: the ratio is 1 with the policy's gradient (TRL's
    per_token_logps.detach() when it has no old_per_token_logps), and nothing clips."""
    trainer, setup, state = sides
    inputs = _inputs(trainer)
    rollouts = _rollouts_of(inputs)._replace(old_logps=None)
    del inputs["old_per_token_logps"]
    settings = LossSettings(loss_type="grpo", beta=0.04)
    loss, norm, theirs = _trl_loss(trainer, inputs, settings)
    with jax.set_mesh(setup.mesh):
        (ours_loss, ours), grads = jax.jit(jax.value_and_grad(
            lambda p: grpo_objective(p, setup.graphdef, rollouts, settings, TEMPERATURE),
            has_aux=True))(state.params)
    np.testing.assert_allclose(float(ours_loss), loss, rtol=1e-5)
    np.testing.assert_allclose(float(optax.tree.norm(grads)), norm, rtol=1e-5)
    np.testing.assert_allclose(float(ours["kl"]), theirs["kl"], rtol=1e-5)
    assert float(ours["clip_ratio/region_mean"]) == theirs["clip_ratio/region_mean"] == 0.0


def torch_tensor(array):
    import torch

    return torch.from_numpy(array)


@pytest.mark.slow
def test_micro_batches_average_to_the_whole_batch(sides):
    """Two micro-batches of rows (i, i + 2, ...), the step's mean of their losses and
    gradients, give the whole batch's: dapo's normaliser is the step's token count (grpo's
    and dr_grpo's means over rows average without it)."""
    trainer, setup, state = sides
    rollouts = _rollouts_of(_inputs(trainer))
    settings = LossSettings(loss_type="dapo", beta=0.04, epsilon_high=0.28)

    @jax.jit
    def value_and_grad(params, batch, microbatches):
        return jax.value_and_grad(lambda p: grpo_objective(
            p, setup.graphdef, batch, settings, TEMPERATURE, microbatches=microbatches)[0])(
            params)

    with jax.set_mesh(setup.mesh):
        whole, grads = value_and_grad(state.params, rollouts, 1)
        halves = [value_and_grad(state.params, jax.tree.map(lambda x: x[i::2], rollouts), 2)
                  for i in range(2)]
    np.testing.assert_allclose(float(halves[0][0] + halves[1][0]) / 2, float(whole), rtol=1e-5)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, halves[0][1], halves[1][1])
    np.testing.assert_allclose(float(optax.tree.norm(mean)), float(optax.tree.norm(grads)),
                               rtol=1e-5)


def test_truncated_completions_are_masked_as_trl_masks_them(sides):
    trainer, _, _ = sides
    full, cut = (_trl_batch(trainer, mask_truncated=m) for m in (False, True))
    ids, mask = jnp.asarray(full["completion_ids"].numpy()), jnp.asarray(
        full["completion_mask"].numpy())
    ours = truncation_mask(ids, mask, trainer.eos_token_ids + [PAD])
    np.testing.assert_array_equal(ours, cut["completion_mask"].numpy())
    assert np.flatnonzero(np.asarray(ours).any(1)).tolist() == ENDS_IN_EOS


def test_a_batch_of_rollouts_is_laid_out_as_trl_lays_it_out(sides):
    """Prompts of several lengths (left-padded), completions right-padded, truncated ones
    masked: rollout_batch's ids and masks and rollout_advantages' advantages are TRL's."""
    trainer, _, _ = sides
    prompts, completions = _rollouts()
    prompts = [p[:2 + i % 3] for i, p in enumerate(prompts)]
    fixed = trainer._generate
    trainer._generate = lambda _: (prompts, completions, None, ["c"] * 8, None, {}, None, None)
    try:
        theirs = _trl_batch(trainer, "batch", mask_truncated=True)
    finally:
        trainer._generate = fixed
    rewards = [Reward("score_a", score_a, WEIGHTS[0]), Reward("score_b", score_b, WEIGHTS[1])]
    advantages, _ = rollout_advantages(rewards, ["t2"] * 8, ["c"] * 8, completions,
                                       {"a": SCORE_A, "b": SCORE_B}, GENERATIONS, "batch")
    ours = rollout_batch(prompts, completions, advantages, PAD, trainer.eos_token_ids,
                         mask_truncated=True)
    want = np.concatenate([theirs["prompt_ids"].numpy(), theirs["completion_ids"].numpy()], 1)
    np.testing.assert_array_equal(ours.ids, want)
    np.testing.assert_array_equal(ours.prompt_mask, theirs["prompt_mask"].numpy())
    np.testing.assert_array_equal(ours.completion_mask, theirs["completion_mask"].numpy())
    np.testing.assert_allclose(ours.advantages, theirs["advantages"].numpy(), rtol=1e-5,
                               atol=1e-6)
    assert ours.num_items[0] == float(theirs["num_items_in_batch"])
    assert ours.prompt_mask.sum(1).tolist() == [len(p) for p in prompts]


def test_left_padded_prompts_score_as_unpadded_ones(sides):
    """rollout_layout: a prompt left-padded by 3 gives its completion the log-probs of the
    same row unpadded (positions from the first real token, padding unseen)."""
    _, setup, state = sides
    prompts, completions = _rollouts()
    row = np.asarray(prompts[0] + completions[0], np.int32)[None]
    padded = np.concatenate([np.full((1, 3), PAD, np.int32), row], 1)
    width = len(completions[0])
    layout = rollout_layout(jnp.asarray([[0, 0, 0] + [1] * PROMPT]), jnp.ones((1, width)))
    with jax.set_mesh(setup.mesh):
        plain = completion_logps(state.params, setup.graphdef, jnp.asarray(row), width)[0]
        shifted = completion_logps(state.params, setup.graphdef, jnp.asarray(padded), width,
                                   *layout)[0]
    np.testing.assert_allclose(shifted, plain, rtol=1e-5, atol=1e-6)


def test_settings_refuse_in_one_line():
    from jaxtrain.errors import ConfigError

    for bad, says in [(dict(loss_type="ppo"), "train.grpo.loss_type"),
                      (dict(importance_sampling_level="batch"), "importance_sampling_level"),
                      (dict(loss_type="dr_grpo"), "max_completion_length"),
                      (dict(beta=-1.0), "train.grpo.beta")]:
        with pytest.raises(ConfigError, match=says) as e:
            LossSettings(**bad)
        assert "\n" not in str(e.value)
    assert dataclasses.replace(LossSettings(), epsilon=0.1).high == 0.1
