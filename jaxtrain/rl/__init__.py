"""The numeric core of RL with verifiable rewards (issue #49: train.objective=grpo and its
successors), apart from the engine that produces the rollouts.

- rewards.py: reward functions of TRL's signature f(prompts, completions, **columns), the
  built-ins (final-answer match, format regex, DAPO's soft overlong punishment), user
  functions by import path, and one batch scored into [N, F] (None -> NaN).
- advantages.py: the weighted reward of each completion and its group-relative advantage
  (scale_rewards group / batch / none), as TRL's GRPOTrainer computes them; DAPO's dynamic
  sampling (drop the groups whose rewards are all equal).
- loss.py: the clipped surrogate per token and its normalisations (loss_type grpo, bnpo,
  dr_grpo, dapo, cispo, sapo, luspo; GSPO by importance_sampling_level='sequence'), the
  k3 KL penalty against a reference, and TRL's metrics; a pure jnp function of [B, T]
  log-probabilities.
- logps.py: the per-token log-probabilities (and entropies) of completions under the model,
  chunked over the sequence like the DPO objective's (models/head_loss.py).
- batch.py, objective.py: the engine's rollouts -> a Rollouts batch (padding, truncation
  masks, advantages, the step's token count) -> the step's loss (grpo_objective).

Everything is checked against TRL 1.16's GRPOTrainer itself (tests/parity/test_grpo_loss.py).
"""
