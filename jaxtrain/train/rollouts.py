"""The GRPO loop's batches (train.objective='grpo'): each step's prompts drawn from the
prompt set, sampled with the engine on the parameters the step starts from (the state's
own arrays: no copy), scored by the reward functions, and made a Rollouts batch.

Everything is a function of (seed, step) and the state: the prompts (data/prompt_set.py),
and each prompt's sampling seed, so a resumed run samples exactly what the uninterrupted
run sampled. A reward function that raises ends the step before anything is applied
(RewardError, one line naming the function and the prompt).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxtrain.data import prompt_set, record
from jaxtrain.engine.engine import Engine
from jaxtrain.engine.requests import Request, SamplingParams
from jaxtrain.engine.steps import Model
from jaxtrain.errors import DataError
from jaxtrain.objectives import abstract_rollouts, reward_entries
from jaxtrain.rl.advantages import group_advantages, varied_groups, weighted_rewards
from jaxtrain.rl.batch import rollout_batch
from jaxtrain.rl.objective import Rollouts, shard_rollouts
from jaxtrain.rl.rewards import build_rewards, score


def sampling_seed(seed: int, step: int, prompt: int) -> int:
    """The engine seed of a step's prompt (its G samples differ by their index)."""
    return int(np.random.SeedSequence([seed, step, prompt]).generate_state(1)[0])


class Rollouter:
    """The run's source of Rollouts batches, in place of data/batches.py's Batches."""

    def __init__(self, cfg):
        g = cfg.train.grpo
        self.cfg, self.g = cfg, g
        self.prompts = prompt_set.load(cfg.data.path)
        self.tokenizer = record.data_tokenizer(cfg)
        self.width = self.prompts.longest  # every step's prompt width: one compiled shape
        if self.width + g.max_completion_length > cfg.model.seq_len:
            raise DataError(
                f"data.path={cfg.data.path!r}: its longest prompt ({self.width} tokens) plus "
                f"train.grpo.max_completion_length={g.max_completion_length} exceed "
                f"model.seq_len={cfg.model.seq_len}; prepare with --max-length or shorten")
        self.rewards = build_rewards(reward_entries(cfg))
        eos = getattr(self.tokenizer, "eos_id", None)
        self.eos_ids = () if eos is None else (eos,)
        self.engine: Engine | None = None

    def val_batches(self) -> list:
        return []  # no validation loss: the rewards are the measure

    def example(self, setup) -> Rollouts:
        """The abstract batch the step compiles for."""
        return abstract_rollouts(self.cfg, self.width, setup.tokens_sharding)

    def _engine(self, setup, params) -> Engine:
        model = Model(setup.graphdef, params, setup.mesh, setup.spec.rules,
                      setup.spec.vocab_size, setup.spec.seq_len)
        if self.engine is None:
            self.engine = Engine(model, slots=self.g.slots or self.cfg.train.global_batch,
                                 max_len=self.width + self.g.max_completion_length,
                                 eos_ids=self.eos_ids, tokenizer=self.tokenizer)
        else:  # the state's new arrays; the compiled steps stay
            self.engine.model = model
            with jax.set_mesh(setup.mesh):
                self.engine.cache = self.engine.steps.init_cache(params)
        return self.engine

    def _requests(self, step: int, indices) -> list[Request]:
        g = self.g
        stop = (str(g.stop),) if str(g.stop) else ()
        return [Request(tuple(self.prompts.lines[i]["prompt_ids"]), SamplingParams(
            max_new_tokens=g.max_completion_length, temperature=float(g.temperature),
            top_k=int(g.top_k), top_p=float(g.top_p), min_p=float(g.min_p),
            seed=sampling_seed(self.cfg.seed, step, k), n=g.num_generations, stop=stop))
            for k, i in enumerate(indices)]

    def batch(self, setup, step: int, state) -> tuple[Rollouts, dict]:
        """(the step's Rollouts as global arrays, its host metrics: rewards, lengths,
        rollout tokens/s and the time split)."""
        g = self.g
        indices = self.prompts.step_indices(self.cfg.seed, step,
                                            self.cfg.train.global_batch // g.num_generations)
        began = time.perf_counter()
        engine = self._engine(setup, state.model_params())
        done = [c for cs in engine.generate(self._requests(step, indices)) for c in cs]
        # The KV cache lives while sampling only: the update's activations take its place.
        engine.cache = None
        generated = time.perf_counter()
        lines = [self.prompts.lines[i] for i in np.repeat(indices, g.num_generations)]
        rollouts, metrics = self._scored(lines, done)
        scored = time.perf_counter()
        tokens = sum(len(c.ids) for c in done)
        metrics.update({"rollout_tokens_per_s": tokens / max(generated - began, 1e-9),
                        "time/generate_s": generated - began, "time/score_s": scored - generated})
        return shard_rollouts(rollouts, setup.tokens_sharding), metrics

    def _scored(self, lines: list[dict], done) -> tuple[Rollouts, dict]:
        """The host Rollouts of the completions of `lines` (one line per completion)."""
        g = self.g
        ids = [c.ids for c in done]
        texts = [c.text if c.text is not None else "" for c in done]
        columns = {k: [line.get(k) for line in lines] for k in self.prompts.columns}
        values_NF, metrics = score(self.rewards, [line["prompt"] for line in lines], texts,
                                   ids, columns)
        rewards_N = weighted_rewards(values_NF, [r.weight for r in self.rewards])
        advantages_N, reward_metrics = group_advantages(rewards_N, g.num_generations,
                                                        g.scale_rewards)
        rollouts = rollout_batch([line["prompt_ids"] for line in lines], ids, advantages_N,
                                 pad_id=self.eos_ids[0] if self.eos_ids else 0,
                                 prompt_width=self.width,
                                 completion_width=g.max_completion_length)
        clipped_N = np.asarray([c.finish_reason == "length" for c in done])
        keep_N = np.ones(len(done), bool)
        if g.mask_truncated_completions:
            keep_N &= ~clipped_N
        if g.dynamic_sampling:
            keep_N &= varied_groups(rewards_N, g.num_generations)
        mask = rollouts.completion_mask * keep_N[:, None].astype(np.int32)
        rollouts = rollouts._replace(completion_mask=mask,
                                     num_items=np.full(len(done), mask.sum(), np.float32))
        lengths = np.asarray([len(c) for c in ids])
        metrics.update(reward_metrics)
        metrics.update({"completions/mean_length": float(lengths.mean()),
                        "completions/max_length": float(lengths.max()),
                        "completions/min_length": float(lengths.min()),
                        "completions/clipped_ratio": float(clipped_N.mean()),
                        "kept_ratio": float(keep_N.mean())})
        return rollouts, metrics


def host_metrics(values: dict) -> dict:
    """Host floats as the step's metrics take them (the logger reads device values)."""
    return {k: np.float32(v) for k, v in values.items()}


@dataclasses.dataclass
class RolloutFeed:
    """fetch(step, state) -> (the step's batch, host metrics), for the loop."""

    rollouter: Rollouter
    setup: object

    def __call__(self, step: int, state):
        batch, metrics = self.rollouter.batch(self.setup, step, state)
        return batch, host_metrics(metrics)

