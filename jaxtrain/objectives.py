"""Training objectives (`train.objective`): what the step minimises and evaluation reports.

One `Objective` per entry of OBJECTIVES, beside the loop's one step (train/step.py), not a
fork of it. An entry builds its loss from the model's graphdef and the reference model's
(LoRA: the model without adapters; otherwise the model itself), and carries what the step
and the planner need to know of it: how micro-batches are weighted, how many forward
passes of a frozen reference a step runs, and whether the state holds a copy of the
parameters as that reference.

- `lm`: next-token cross entropy (the mean over the counted targets of packed or chat
  rows), plus an MoE model's weighted router losses.
- `dpo`: Direct Preference Optimization (Rafailov et al. 2023), sigmoid loss, on rows of
  preference pairs (data.packing='pairs': segment 1 the prompt + chosen reply, segment 2
  the prompt + rejected reply, the loss mask on the replies). A sequence's log-likelihood
  is the sum of the log-probabilities of its counted targets;
  loss = mean over pairs of −log σ(β·((π_c − r_c) − (π_r − r_r))), where π is the policy's
  and r the frozen reference's. The reference is LoRA's frozen base (the same arrays, no
  second copy), or without LoRA a frozen copy of the starting parameters held in the
  state (train/frozen.py, role "reference"): computed on the fly, docs/finetune.md says why.
- `simpo`: SimPO (Meng et al. 2024), reference-free, on the same rows of pairs: a reply's
  score is its mean log-probability over its counted targets (TRL's average_log_prob);
  loss = mean over pairs of −log σ(β·(π̄_c − π̄_r) − γ) (with label smoothing ε:
  −(1−ε)·log σ(z) − ε·log σ(−z)), as TRL's CPOTrainer with loss_type='simpo' and
  cpo_alpha=0. No reference model: nothing is loaded, held or run for one.
- `grpo`: GRPO and its family (TRL 1.16's GRPOTrainer, jaxtrain/rl/): each step the loop
  samples train.grpo.num_generations completions of each of its prompts with the engine
  on the parameters being trained (train/rollouts.py), scores them with the reward
  functions, and the step minimises rl/objective.py's grpo_objective on them. Its KL
  reference (train.grpo.beta > 0) is LoRA's frozen base, or a frozen copy as DPO's.

An entry names the batch layouts it trains on (`layouts`, data/layouts.py) and carries the
defaults of its own config section (`train.<name>`, `defaults`), which config.py assembles.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.data.layouts import LAYOUTS
from jaxtrain.data.packing import Packed, batch_targets
from jaxtrain.errors import ConfigError, fail
from jaxtrain.models.head_loss import head_cross_entropy, logits_chunk, token_logprobs
from jaxtrain.parallel.context import to_layout
from jaxtrain.rl.advantages import SCALES
from jaxtrain.rl.loss import LossSettings
from jaxtrain.rl.objective import Rollouts, grpo_objective
from jaxtrain.rl.rewards import build_rewards

# Logged by the dpo objective (TRL's DPOTrainer names), and by simpo (CPOTrainer's: the
# same names, its rewards being β times the mean log-probabilities).
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
               "logps/chosen", "logps/rejected")
SIMPO_METRICS = DPO_METRICS
# A DPO margin within this many float32 epsilons of the pair's log-likelihoods (their
# summed magnitudes, times beta) is a tie (dpo_per_pair).
TIE_ULPS = 8


def loss_fn(params: dict, graphdef: nnx.GraphDef, tokens_BT) -> jax.Array:
    """Mean next-token cross entropy; tokens_BT holds seq_len + 1 tokens per row, or is a
    Packed batch of documents (mean over its counted targets).

    Equals softmax cross entropy of model(inputs) logits, but the head and the loss run fused
    over sequence chunks (models/head_loss.py) so the B·L·V logits never exist at once.
    """
    return _forward(params, graphdef, tokens_BT)[0]


def objective_fn(params: dict, graphdef: nnx.GraphDef, tokens_BT) -> tuple[jax.Array, dict]:
    """(what training minimises, metrics of the forward pass): the cross entropy, plus for
    an MoE model its routers' weighted auxiliary losses, with the cross entropy as `loss`
    and the routing metrics (models/moe.py routing_losses) among the metrics."""
    loss, penalty, metrics = _forward(params, graphdef, tokens_BT)
    if penalty is None:
        return loss, metrics
    return loss + penalty, {"loss": loss, **metrics}


def _forward(params: dict, graphdef: nnx.GraphDef, tokens_BT):
    """(cross entropy, the MoE routers' weighted auxiliary loss or None, routing metrics)
    of a batch: seq_len + 1 tokens per row, or Packed documents (the mean over its counted
    targets)."""
    model = nnx.merge(graphdef, params)
    head, vocab_major = model.head_as_stored()
    inputs_BL, targets_BL, documents, counted_BL = _laid_out(tokens_BT, model.spec.context)
    features, penalty, metrics = model.features_and_aux(inputs_BL, *documents)
    loss = head_cross_entropy(features, head, targets_BL, model.spec.rules, vocab_major,
                              counted_BL, model.spec.final_softcap)
    return loss, penalty, metrics


def _laid_out(tokens_BT, context):
    """(inputs, targets, (segments, positions) or (), counted targets or None) of a batch,
    in the sequence order of the context layout (parallel/context.py): under its load
    balance every per-position array takes the same zig-zag permutation, positions included
    (the row's own, so that RoPE and learned positions see the original order). The loss
    sums over tokens, so nothing is put back."""
    if isinstance(tokens_BT, Packed):
        tokens, documents = tokens_BT.tokens, (tokens_BT.segments[:, :-1],
                                              tokens_BT.positions[:, :-1])
        counted_BL = batch_targets(tokens_BT)  # a chat dataset's loss mask included
    else:
        tokens, documents, counted_BL = tokens_BT, (), None
    inputs_BL, targets_BL = tokens[:, :-1], tokens[:, 1:]
    if context is None or not context.load_balance:
        return inputs_BL, targets_BL, documents, counted_BL
    if not documents:
        positions_BL = jnp.broadcast_to(jnp.arange(inputs_BL.shape[1]), inputs_BL.shape)
        documents = (None, positions_BL)
    laid = [None if x is None else to_layout(x, context)
            for x in (inputs_BL, targets_BL, *documents, counted_BL)]
    return laid[0], laid[1], tuple(laid[2:4]), laid[4]


# --- dpo -----------------------------------------------------------------------------------

def segment_logps(params: dict, graphdef: nnx.GraphDef, pairs: Packed):
    """(([B] chosen, [B] rejected) log-likelihoods, ([B] chosen, [B] rejected) counted
    targets, MoE penalty or None, routing metrics) of rows of pairs: the sums of
    log p(target) over each segment's counted targets (the replies: the loss mask), and
    how many there are; segment 1 chosen, 2 rejected."""
    model = nnx.merge(graphdef, params)
    head, vocab_major = model.head_as_stored()
    inputs_BL, targets_BL, documents, counted_BL = _laid_out(pairs, model.spec.context)
    features, penalty, metrics = model.features_and_aux(inputs_BL, *documents)
    logp_BL = token_logprobs(features, head, targets_BL, model.spec.rules, vocab_major,
                             model.spec.final_softcap)
    # A counted target is of its input's segment (packing.counted_targets).
    segments_BL = documents[0]
    in_segment = [counted_BL & (segments_BL == k) for k in (1, 2)]
    sums = tuple(jnp.where(m, logp_BL, 0.0).sum(axis=-1) for m in in_segment)
    counts = tuple(m.sum(axis=-1, dtype=jnp.float32) for m in in_segment)
    return sums, counts, penalty, metrics


def pair_logps(params: dict, graphdef: nnx.GraphDef, pairs: Packed):
    """([B] chosen, [B] rejected log-likelihoods, MoE penalty or None, routing metrics) of
    rows of pairs (segment_logps' sums)."""
    sums, _, penalty, metrics = segment_logps(params, graphdef, pairs)
    return sums[0], sums[1], penalty, metrics


def dpo_per_pair(policy_c_B, policy_r_B, reference_c_B, reference_r_B, beta: float
                 ) -> dict:
    """{name: [B] per pair}: the sigmoid DPO loss (`loss`) and TRL's reward metrics.

    A pair's win (`rewards/accuracies`) is TRL's chosen reward > rejected reward, a tie
    being no win. The reference and the policy pass are compiled apart (one is
    differentiated, the other not), so where they hold the same parameters their sums can
    differ in the last bits and a tie would count as a win at random: a margin within
    float32 rounding of the four log-likelihoods is a tie."""
    chosen_B = beta * (policy_c_B - reference_c_B)
    rejected_B = beta * (policy_r_B - reference_r_B)
    margin_B = chosen_B - rejected_B
    scale_B = beta * (jnp.abs(policy_c_B) + jnp.abs(policy_r_B) + jnp.abs(reference_c_B)
                      + jnp.abs(reference_r_B))
    won_B = margin_B > TIE_ULPS * jnp.finfo(jnp.float32).eps * scale_B
    return {"loss": -jax.nn.log_sigmoid(margin_B), "rewards/chosen": chosen_B,
            "rewards/rejected": rejected_B, "rewards/margins": margin_B,
            "rewards/accuracies": won_B.astype(jnp.float32), "logps/chosen": policy_c_B,
            "logps/rejected": policy_r_B}


def dpo_loss(policy_c_B, policy_r_B, reference_c_B, reference_r_B, beta: float
             ) -> tuple[jax.Array, dict]:
    """(mean sigmoid DPO loss, TRL's reward metrics) of per-pair log-likelihoods."""
    means = {k: v.mean() for k, v in dpo_per_pair(policy_c_B, policy_r_B, reference_c_B,
                                                   reference_r_B, beta).items()}
    return means.pop("loss"), means


def dpo_objective(params: dict, graphdef: nnx.GraphDef, reference: dict,
                  reference_graphdef: nnx.GraphDef, pairs: Packed, beta: float
                  ) -> tuple[jax.Array, dict]:
    """(DPO loss, plus an MoE model's router losses; metrics): the reference forward runs
    on `reference` under stop_gradient (LoRA's frozen base, or the frozen copy)."""
    policy_c, policy_r, penalty, metrics = pair_logps(params, graphdef, pairs)
    reference_c, reference_r = _reference_logps(reference, reference_graphdef, pairs)
    loss, rewards = dpo_loss(policy_c, policy_r, reference_c, reference_r, beta)
    if penalty is None:
        return loss, {**rewards, **metrics}
    return loss + penalty, {"loss": loss, **rewards, **metrics}


def _reference_logps(reference, reference_graphdef, pairs: Packed):
    reference_c, reference_r, _, _ = pair_logps(jax.lax.stop_gradient(reference),
                                                reference_graphdef, pairs)
    return jax.lax.stop_gradient(reference_c), jax.lax.stop_gradient(reference_r)


def dpo_sums(params: dict, graphdef: nnx.GraphDef, reference: dict,
             reference_graphdef: nnx.GraphDef, pairs: Packed, beta: float) -> dict:
    """What evaluation adds up over a batch of pairs: pair_sums of dpo_per_pair."""
    policy_c, policy_r, _, _ = pair_logps(params, graphdef, pairs)
    reference_c, reference_r = _reference_logps(reference, reference_graphdef, pairs)
    return pair_sums(pairs, dpo_per_pair(policy_c, policy_r, reference_c, reference_r, beta))


def pair_sums(pairs: Packed, per_pair: dict) -> dict:
    """Each per-pair value summed over the batch's pairs, and `weight`, the pairs (rows
    holding a chosen reply: an empty row, the padding of a last batch, counts nothing)."""
    real_B = (batch_targets(pairs) & (pairs.segments[:, :-1] == 1)).any(axis=-1)
    return {"weight": real_B.sum(dtype=jnp.float32),
            **{k: jnp.where(real_B, v, 0.0).sum() for k, v in per_pair.items()}}


def lm_sums(params: dict, graphdef: nnx.GraphDef, tokens_BT) -> dict:
    """What evaluation adds up over a batch: the cross entropy summed over its counted
    targets (`loss`), and their number (`weight`; 0 for a batch with none, which then adds
    nothing: the mean of a split is over its targets, not over its batches)."""
    if isinstance(tokens_BT, Packed):
        count = batch_targets(tokens_BT).sum(dtype=jnp.float32)
    else:
        count = jnp.float32(tokens_BT.shape[0] * (tokens_BT.shape[1] - 1))
    # The mean is the sum over max(count, 1): times the count it is the sum again.
    return {"weight": count, "loss": loss_fn(params, graphdef, tokens_BT) * count}


# --- simpo ---------------------------------------------------------------------------------

def simpo_per_pair(chosen_B, rejected_B, beta: float, gamma: float, smoothing: float = 0.0
                   ) -> dict:
    """{name: [B] per pair}: SimPO's loss (`loss`) and TRL's reward metrics, from each
    reply's mean log-probability (chosen_B, rejected_B), in TRL's CPOTrainer.cpo_loss
    order of operations (logits − γ/β, then times β). A win is a chosen reward above the
    rejected one, as TRL counts it: both come from one forward pass, so no float tie."""
    z_B = beta * ((chosen_B - rejected_B) - gamma / beta)
    loss_B = (-jax.nn.log_sigmoid(z_B) * (1.0 - smoothing)
              - jax.nn.log_sigmoid(-z_B) * smoothing)
    reward_c_B, reward_r_B = beta * chosen_B, beta * rejected_B
    return {"loss": loss_B, "rewards/chosen": reward_c_B, "rewards/rejected": reward_r_B,
            "rewards/margins": reward_c_B - reward_r_B,
            "rewards/accuracies": (reward_c_B > reward_r_B).astype(jnp.float32),
            "logps/chosen": chosen_B, "logps/rejected": rejected_B}


def mean_logps(params: dict, graphdef: nnx.GraphDef, pairs: Packed):
    """([B] chosen, [B] rejected mean log-probabilities over each reply's counted targets,
    MoE penalty or None, routing metrics); an empty row's are 0."""
    sums, counts, penalty, metrics = segment_logps(params, graphdef, pairs)
    chosen_B, rejected_B = (total / jnp.maximum(count, 1.0)
                            for total, count in zip(sums, counts))
    return chosen_B, rejected_B, penalty, metrics


def _simpo_settings(cfg) -> tuple[float, float, float]:
    s = cfg.train.simpo
    return float(s.beta), float(s.simpo_gamma), float(s.label_smoothing)


def _simpo_losses(graphdef, reference_graphdef, cfg) -> tuple[Callable, Callable]:
    del reference_graphdef  # reference-free
    settings = _simpo_settings(cfg)

    def loss(params, pairs, step, reference):
        del step, reference  # LoRA passes its frozen base; SimPO runs no reference on it
        chosen_B, rejected_B, penalty, metrics = mean_logps(params, graphdef, pairs)
        means = {k: v.mean() for k, v in simpo_per_pair(chosen_B, rejected_B,
                                                         *settings).items()}
        value = means.pop("loss")
        if penalty is None:
            return value, {**means, **metrics}
        return value + penalty, {"loss": value, **means, **metrics}

    def evaluate(params, pairs):
        chosen_B, rejected_B, _, _ = mean_logps(params, graphdef, pairs)
        return pair_sums(pairs, simpo_per_pair(chosen_B, rejected_B, *settings))

    return loss, evaluate


def _simpo_defaults() -> dict:
    """train.simpo: TRL's CPOConfig names; the SimPO paper's β and γ (Meng et al. 2024,
    Llama-3-Base), where CPOConfig's defaults (0.1, 0.5) are DPO's scale of β."""
    return {
        "beta": 2.0,  # the reward scale β (TRL's beta)
        "simpo_gamma": 1.0,  # the target reward margin γ (TRL's simpo_gamma)
        "label_smoothing": 0.0,  # ε, conservative labels (TRL's label_smoothing)
    }


def _check_simpo(c) -> None:
    s = c.train.simpo
    if not s.beta > 0:
        fail("train.simpo.beta", s.beta, "must be > 0 (the reward scale, e.g. 2.0)")
    if not 0.0 <= s.label_smoothing < 0.5:
        fail("train.simpo.label_smoothing", s.label_smoothing, "must be in [0, 0.5)")
    _check_pair_data(c, "simpo")
    _check_no_reference(c)


# --- lm, dpo: losses and checks --------------------------------------------------------------

def _dpo_losses(graphdef, reference_graphdef, cfg) -> tuple[Callable, Callable]:
    beta = float(cfg.train.dpo.beta)

    def loss(params, pairs, step, reference):
        del step
        return dpo_objective(params, graphdef, reference, reference_graphdef, pairs, beta)

    def evaluate(params, pairs, reference):
        return dpo_sums(params, graphdef, reference, reference_graphdef, pairs, beta)

    return loss, evaluate


def _lm_losses(graphdef, reference_graphdef, cfg) -> tuple[Callable, Callable]:
    del reference_graphdef, cfg
    return (lambda params, tokens_BT, step, reference: objective_fn(params, graphdef, tokens_BT),
            lambda params, tokens_BT: lm_sums(params, graphdef, tokens_BT))


def _check_no_reference(c) -> None:
    if c.train.dpo.reference:
        fail("train.dpo.reference", c.train.dpo.reference, "goes with train.objective='dpo'")


def _check_pair_data(c, name: str) -> None:
    """What an objective on pairs needs of the data: one prepared dataset of pairs."""
    if c.data.source != "prepared":
        fail("data.source", c.data.source, f"train.objective={name!r} needs data.source="
             "'prepared' (a dataset made by jaxtrain prepare --preference)")
    if c.data.mixture:
        fail("data.mixture", c.data.mixture, "mixtures of preference datasets are not "
             "supported: give one dataset as data.path")


def _dpo_defaults() -> dict:
    return {
        "beta": 0.1,  # the strength of the implicit KL penalty (TRL's beta)
        "reference": "",  # a run directory; empty: the model initialised from seed
    }


def _check_dpo(c) -> None:
    d = c.train.dpo
    if not d.beta > 0:
        fail("train.dpo.beta", d.beta, "must be > 0 (the KL penalty's strength, e.g. 0.1)")
    _check_pair_data(c, "dpo")
    if d.reference and c.model.lora.rank:
        fail("train.dpo.reference", d.reference, "with LoRA the reference is the frozen base "
             "(model.lora.base): leave train.dpo.reference empty")


# --- grpo ----------------------------------------------------------------------------------

# Logged by the grpo objective beside the loss's own (rl/loss.py: kl, clip_ratio/*,
# entropy) and the rollout's (train/rollouts.py): TRL's GRPOTrainer names.
GRPO_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "completions/max_length", "completions/clipped_ratio")


def _grpo_defaults() -> dict:
    """train.grpo: TRL GRPOConfig's names and, where they fit a small run, its defaults."""
    return {
        "num_generations": 8,  # G completions per prompt; train.global_batch counts them
        "max_completion_length": 64,  # new tokens per completion (TRL: 256)
        # reward functions, comma-separated: built-ins (answer, format, overlong) or
        # module:function (TRL's signature); reward_weights: one float each (empty: 1.0)
        "rewards": "answer",
        "reward_weights": "",
        # JSON {"name": {option: value}} of built-ins' options, e.g.
        # '{"format": {"pattern": "^<think>"}, "answer": {"column": "solution"}}'
        "reward_options": "",
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
        "stop": "",  # a stop string (the prompt set's EOS token always stops)
        "loss_type": "dapo",  # rl/loss.py LOSS_TYPES
        "epsilon": 0.2,
        "epsilon_high": 0.0,  # 0: epsilon (DAPO's clip-higher: 0.28)
        "delta": 0.0,  # 0: off (INTELLECT-2's two-sided clip of the ratio)
        "importance_sampling_level": "token",  # or sequence (GSPO)
        "beta": 0.0,  # the KL coefficient; > 0 runs a frozen reference
        "scale_rewards": "group",  # group, batch, none
        "mask_truncated_completions": False,  # DAPO: completions cut at the length count 0
        "dynamic_sampling": False,  # DAPO: groups whose rewards are all equal count 0
        "num_iterations": 1,  # μ: optimizer updates per generation (all inside one step)
        "reference": "",  # beta > 0 without LoRA: a run directory; empty: the seed's model
        "slots": 0,  # the engine's KV slots; 0: train.global_batch (every sample at once)
    }


def grpo_settings(cfg) -> LossSettings:
    """The loss's settings of train.grpo (ConfigError, one line, for a bad one)."""
    g = cfg.train.grpo
    return LossSettings(loss_type=g.loss_type, epsilon=float(g.epsilon),
                        epsilon_high=float(g.epsilon_high) or None, beta=float(g.beta),
                        importance_sampling_level=g.importance_sampling_level,
                        delta=float(g.delta) or None,
                        max_completion_length=int(g.max_completion_length))


def reward_entries(cfg) -> list[dict]:
    """train.grpo.rewards, reward_weights and reward_options as build_rewards' entries."""
    g = cfg.train.grpo
    names = [n.strip() for n in str(g.rewards).split(",") if n.strip()]
    weights = [w.strip() for w in str(g.reward_weights).split(",") if w.strip()]
    if weights and len(weights) != len(names):
        fail("train.grpo.reward_weights", g.reward_weights,
             f"give one weight per reward function ({len(names)}: {', '.join(names)})")
    try:
        options = json.loads(g.reward_options) if str(g.reward_options).strip() else {}
        weights = [float(w) for w in weights] or [1.0] * len(names)
    except ValueError as e:
        fail("train.grpo.reward_options", g.reward_options, f"not JSON or a bad weight ({e})")
    if not isinstance(options, dict) or set(options) - set(names):
        fail("train.grpo.reward_options", g.reward_options, "must be a JSON object keyed by "
             f"the names in train.grpo.rewards ({', '.join(names)})")
    entries = []
    for name, weight in zip(names, weights):
        entry = {"name": name, "weight": weight, **options.get(name, {})}
        if name == "overlong" and name not in options:  # DAPO's cache: a quarter
            length = int(g.max_completion_length)
            entry.update(max_completion_len=length, soft_punish_cache=max(1, length // 4))
        entries.append(entry)
    return entries


def _check_grpo(c) -> None:
    g, t = c.train.grpo, c.train
    if c.data.source != "prompts":
        fail("data.source", c.data.source, "train.objective='grpo' samples prompts: give "
             "data.source='prompts' and data.path a set made by jaxtrain prepare --prompts")
    for key, low in (("num_generations", 2), ("max_completion_length", 1),
                     ("num_iterations", 1), ("slots", 0), ("top_k", 0)):
        if g[key] < low:
            fail(f"train.grpo.{key}", g[key], f"must be >= {low}")
    if t.global_batch % g.num_generations:
        fail("train.global_batch", t.global_batch, f"counts completions: it must divide by "
             f"train.grpo.num_generations={g.num_generations}")
    if g.slots and g.slots < g.num_generations:
        fail("train.grpo.slots", g.slots, f"must be 0 or >= train.grpo.num_generations="
             f"{g.num_generations} (a prompt's samples decode together)")
    if not g.temperature > 0:
        fail("train.grpo.temperature", g.temperature, "must be > 0 (G samples of a prompt "
             "must differ)")
    if g.scale_rewards not in SCALES:
        fail("train.grpo.scale_rewards", g.scale_rewards, f"valid values are {', '.join(SCALES)}")
    grpo_settings(c)
    build_rewards(reward_entries(c))  # imports user functions: their errors now, one line
    if g.reference and (c.model.lora.rank or not g.beta):
        fail("train.grpo.reference", g.reference, "is the KL reference without LoRA, with "
             "train.grpo.beta > 0 (with LoRA the frozen base is the reference): leave it empty")
    if c.data.mixture:
        fail("data.mixture", c.data.mixture, "train.objective='grpo' reads one prompt set "
             "(data.path)")


def _grpo_losses(graphdef, reference_graphdef, cfg) -> tuple[Callable, Callable]:
    settings, temperature = grpo_settings(cfg), float(cfg.train.grpo.temperature)
    microbatches = int(cfg.train.microbatches)

    def loss(params, rollouts, step, reference):
        del step
        return grpo_objective(params, graphdef, rollouts, settings, temperature,
                              reference if settings.beta else None, reference_graphdef,
                              microbatches)

    def evaluate(params, rollouts):
        raise ConfigError("train.objective='grpo' has no validation loss: its rewards are "
                          "the measure (or jaxtrain generate --prompts)")

    return loss, evaluate


def grpo_needs_reference(cfg) -> bool:
    return cfg.train.grpo.beta > 0


def rollout_shardings(tokens_sharding: NamedSharding) -> Rollouts:
    """The step's Rollouts shardings: rows on the batch axes as token batches, [B] leaves
    too (a 2-D sharding cannot be a 1-D leaf's)."""
    rows = tokens_sharding.spec[0]
    per_row = NamedSharding(tokens_sharding.mesh, PartitionSpec(rows))
    return Rollouts(tokens_sharding, tokens_sharding, tokens_sharding, per_row, per_row)


def abstract_rollouts(cfg, prompt_width: int, tokens_sharding: NamedSharding) -> Rollouts:
    """ShapeDtypeStructs of one step's Rollouts (B = train.global_batch completions of
    prompt_width + max_completion_length tokens)."""
    b, t = cfg.train.global_batch, cfg.train.grpo.max_completion_length
    s = rollout_shardings(tokens_sharding)
    shape = jax.ShapeDtypeStruct
    return Rollouts(shape((b, prompt_width + t), jnp.int32, sharding=s.ids),
                    shape((b, prompt_width), jnp.int32, sharding=s.prompt_mask),
                    shape((b, t), jnp.int32, sharding=s.completion_mask),
                    shape((b,), jnp.float32, sharding=s.advantages),
                    shape((b,), jnp.float32, sharding=s.num_items))


@dataclasses.dataclass(frozen=True)
class Objective:
    """One `train.objective` value."""

    name: str
    doc: str
    # (graphdef, reference graphdef, config) -> (loss(params, batch, step, reference) ->
    # (value, metrics), eval(params, batch[, reference]) -> {"weight": units, name: sum
    # over the units, for each name of `reports`}: train/evaluation.py divides the sums of
    # a set of batches by their weights)
    losses: Callable
    check: Callable  # (config) -> None; ConfigError (one line)
    # How train.microbatches are weighted: "targets" (each micro-batch's mean by its share
    # of the counted targets, for packed rows) or "rows" (equally: the mean over rows/pairs)
    weighting: str
    reference_forwards: int = 0  # planner: forward passes of a frozen reference per step
    # planner: without LoRA the state holds a frozen copy of the parameters (the reference);
    # with LoRA its frozen base is the reference
    holds_reference: bool = False
    # planner: (seq_len, rows, length shards) -> positions per row whose logits the loss
    # forms at once (both objectives read the head through models/head_loss.py's chunks)
    logits_chunk: Callable = logits_chunk
    # What evaluation reports (the in-training val_loss is `loss`; `jaxtrain eval` prints
    # them all), each the mean over `units`: "tokens" (counted targets: perplexity and bits
    # per token and byte follow) or "pairs"
    reports: tuple[str, ...] = ("loss",)
    units: str = "tokens"
    # The data.packing values it trains on (data/layouts.py); None: every layout that no
    # other objective names (rows of tokens: concat, documents, a new one of theirs).
    layouts: tuple[str, ...] | None = None
    # () -> the defaults of its config section train.<name> (None: it has none).
    defaults: Callable | None = None
    # (config) -> whether this run holds or runs the reference (holds_reference,
    # reference_forwards apply only then); None: always
    needs_reference: Callable | None = None
    # The loop samples its batches with the model being trained (train/rollouts.py): no
    # batches of a dataset, no validation loss; its batch is a Rollouts
    # (rollout_shardings, abstract_rollouts).
    rollouts: bool = False

    def with_reference(self, cfg) -> bool:
        return self.needs_reference is None or bool(self.needs_reference(cfg))

    def takes(self, layout: str) -> bool:
        """Whether it trains on rows of this data.packing value."""
        if self.layouts is not None:
            return layout in self.layouts
        return not any(o.layouts and layout in o.layouts for o in OBJECTIVES.values())


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("lm", "next-token cross entropy over the counted targets (+ MoE router losses)",
              _lm_losses, _check_no_reference, weighting="targets"),
    Objective("dpo", "Direct Preference Optimization (sigmoid loss, beta train.dpo.beta) "
              "on rows of preference pairs, against a frozen reference",
              _dpo_losses, _check_dpo, weighting="rows", reference_forwards=1,
              holds_reference=True, reports=("loss", *DPO_METRICS), units="pairs",
              layouts=("pairs",), defaults=_dpo_defaults),
    Objective("simpo", "SimPO (TRL's CPOTrainer loss_type='simpo', cpo_alpha=0): "
              "reference-free, mean log-probabilities, margin train.simpo.simpo_gamma",
              _simpo_losses, _check_simpo, weighting="rows", reports=("loss", *SIMPO_METRICS),
              units="pairs", layouts=("pairs",), defaults=_simpo_defaults),
    Objective("grpo", "GRPO and its family (TRL's GRPOTrainer: loss train.grpo.loss_type) on "
              "completions the engine samples each step from a prompt set, scored by "
              "train.grpo.rewards", _grpo_losses, _check_grpo, weighting="rows",
              reference_forwards=1, holds_reference=True, reports=("loss", *GRPO_METRICS),
              units="completions", defaults=_grpo_defaults,
              needs_reference=grpo_needs_reference, rollouts=True),
)}


def defaults() -> dict:
    """`train.objective` and each objective's own section (train.dpo, ...) of
    config.base_config()'s `train` section (docs/finetune.md)."""
    return {
        # What the step minimises (OBJECTIVES, docs/finetune.md): lm (next-token cross
        # entropy), dpo (preference pairs against a frozen reference: LoRA's base, or
        # train.dpo.reference's parameters, also the starting ones), simpo (pairs, no
        # reference), grpo (completions sampled from a prompt set and rewarded: train.grpo).
        "objective": "lm",
        **{o.name: o.defaults() for o in OBJECTIVES.values() if o.defaults is not None},
    }


def document_masks(cfg) -> bool:
    """Whether the attention kernels get segment ids: the batch layout's document masks,
    or an objective's rollouts (left-padded prompts, right-padded completions)."""
    return LAYOUTS[cfg.data.packing].segments or OBJECTIVES[cfg.train.objective].rollouts


def training_on(layout: str) -> str:
    """"train.objective='a' or 'b'": the objectives that train on rows of a layout."""
    return " or ".join(f"train.objective={o.name!r}" for o in OBJECTIVES.values()
                       if o.takes(layout))


def check(c) -> None:
    """The chosen objective's config checks: it takes data.packing's rows, then its own
    entry's (ConfigError, one line)."""
    objective, packing = OBJECTIVES[c.train.objective], c.data.packing
    if not objective.takes(packing):
        takes = " or ".join(repr(n) for n in LAYOUTS if objective.takes(n))
        fail("data.packing", packing, f"{LAYOUTS[packing].doc} train {training_on(packing)}; "
             f"train.objective={objective.name!r} takes data.packing={takes}")
    if c.data.source == "prompts" and not objective.rollouts:
        fail("data.source", c.data.source, "a prompt set is sampled from: it trains "
             f"train.objective='grpo', not {objective.name!r}")
    objective.check(c)
