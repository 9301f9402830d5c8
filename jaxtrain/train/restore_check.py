"""A restored state is checked before it is trusted.

Checksums vouch that a checkpoint's bytes are the ones written; a step committed without a
manifest (the process died between orbax's commit and the checksums) has nothing to be
checked against, and if its bytes were also damaged (a machine crash before they reached
the disk) orbax restores the damage without complaint. So the state itself is checked:

- on restore: every leaf finite, and Adam's second moments (sums of squares) not negative,
  in one jitted pass on the devices (one bool per leaf comes back); and every floating
  leaf's sum of squares as recorded when the step was saved (checkpoint.tree_sums: damage
  that leaves the values finite, such as a weight of -1.9e38, or zeros where a page never
  reached the disk), and every numeric leaf's exact sum of its bits (checkpoint.tree_bits:
  damage the sums of squares cannot see, such as tiny second moments made tinier or an
  integer counter);
- after the first step: its loss finite, and near the loss metrics.jsonl logged for that
  step when there is such a row (a resume is bitwise the same run, so on the same mesh the
  two are equal; see LOSS_TOLERANCE), and the state the step produced finite (damage that
  only the update meets: a negative second moment makes every parameter it touches NaN).

A state that fails is set aside like a damaged checkpoint (RestoreRejected; the loop moves
it to `checkpoints_damaged/`) and the run falls back to the previous one; a checkpoint
without a manifest gets one (`Checkpoints.vouch`) only once its state has passed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.checkpoint import tree_bits, tree_sums
from jaxtrain.optim import adam_moments, skipped_steps
from jaxtrain.train.hooks import Hook, StepInfo
from jaxtrain.train.state import TrainState, on_device

# How far the first step's loss may be from the logged one, relative to it (at least 1.0).
# The same config on the same mesh repeats it bit for bit; another mesh, attention kernel or
# micro-batch count changes it by float reassociation (1e-5 in float32, ~1e-3 in bfloat16).
# The damage this check is for (flipped exponent or sign bits: values of 1e30, or hundreds
# where weights are ~0.02) moves it by far more than 1%, or to NaN.
LOSS_TOLERANCE = 0.01
# How far a leaf's sum of squares may be from the one recorded at save, relative to it. The
# same mesh repeats it bit for bit; on another, float32 accumulation in another order moves
# it by ~1e-7·sqrt(elements per device) at worst (1e-3 for a 1e8-element shard). A rejected
# checkpoint costs the steps since the previous one, so this errs wide: the damage it is
# for moves it by orders of magnitude (or to inf).
SUM_TOLERANCE = 0.01


class RestoreRejected(Exception):
    """The state restored from a checkpoint failed its checks: the checkpoint is damaged."""

    def __init__(self, restored, problem: str):
        super().__init__(problem)
        self.restored, self.problem = restored, problem

    def set_aside(self) -> None:
        self.restored.tier.set_aside_damaged(self.restored.step, self.problem)


@functools.lru_cache(maxsize=8)
def _verdicts(mesh):
    """jit(tree, moments) -> [bool]: per floating leaf of the tree 'not all finite', then
    per second moment 'some entry negative'; the small result replicated, so that every
    process can read it."""
    def bad(tree, nu):
        floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
        return jnp.stack([~jnp.all(jnp.isfinite(x)) for x in floats]
                         + [jnp.any(x < 0) for x in jax.tree.leaves(nu)])
    return jax.jit(bad, out_shardings=NamedSharding(mesh, P()))


def state_problem(state: TrainState, shardings: TrainState) -> str | None:
    """What makes `state` impossible (a non-finite leaf, a negative second moment), or
    None. `shardings`: the state's, to bring moments offloaded to the host to the devices
    for the check (a no-op for everything already there)."""
    # The checkpointed part only (a LoRA base, a DPO reference: loaded afresh, never
    # restored).
    state = jax.device_put(state.without_frozen_params(),
                           on_device(shardings.without_frozen_params()))
    tree, (_, nu) = state.tree(), adam_moments(state.opt_state)
    bad = np.asarray(_verdicts(shardings.step.mesh)(tree, nu))
    if not bad.any():
        return None
    floats = [path for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
              if jnp.issubdtype(x.dtype, jnp.floating)]
    first = int(np.argmax(bad))
    if first < len(floats):
        return f"its state holds values that are not finite ({_name(floats[first])})"
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(nu)[0]]
    return (f"Adam's second moment of {_name(paths[first - len(floats)])} holds negative "
            "values (it is a running mean of squares)")


def contents_problem(tree: dict, saved: dict | None) -> str | None:
    """How a restored tree differs from the fingerprints recorded when it was saved
    (Checkpoints.restore_sums; None: it does not, or none were recorded): the sums of
    squares first (their message says how far off a leaf is), then the exact bit sums."""
    if not saved:
        return None
    now = tree_sums(tree)
    for name, before in saved.get("sum_of_squares", {}).items():
        after = now.get(name, before)
        if not math.isclose(after, before, rel_tol=SUM_TOLERANCE):
            return (f"its contents are not what was saved (the sum of squares of {name} is "
                    f"{after:.6g}, saved as {before:.6g})")
    bits = saved.get("bit_sums")
    if bits:
        now_bits = tree_bits(tree)
        for name, before in bits.items():
            after = now_bits.get(name, before)
            if after != before:
                return (f"its contents are not what was saved (the bits of {name} sum to "
                        f"{after:#010x}, saved as {before:#010x})")
    return None


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def restored_streak(state: TrainState) -> int:
    """Non-finite steps in a row when the state was saved (0: it was saved while training
    normally)."""
    return int(jax.device_get(skipped_steps(state.opt_state)[1]))


def expected_first_loss(logged: dict[int, float], step: int, cfg, saved: dict) -> float | None:
    """The loss logged for the first step after restoring `step` (step + 1), when there is
    such a row and this run trains that step on the same batch with the same precision as
    the run that logged it (the same seed and train.precision as the checkpoint's run, data
    not allowed to change); else None. `logged`: process 0's; every process gets its
    answer, so that they all judge alike."""
    value = logged.get(step + 1)
    same = (saved.get("seed") == cfg.seed and not cfg.data.allow_changed
            and saved.get("train", {}).get("precision") == cfg.train.precision)
    found = np.array([value is not None and same, value if value is not None else 0.0])
    if jax.process_count() > 1:
        found = multihost_utils.broadcast_one_to_all(found)
    return float(found[1]) if found[0] else None


def first_loss_problem(loss: float, expected: float | None, step: int, streak: int
                       ) -> str | None:
    """What is wrong with the first loss after restoring `step`, or None. A non-finite one
    is the state's fault unless the state was saved during a run of non-finite steps
    (`streak` > 0: then it carries on the run's trouble, BadStepGuard's matter)."""
    logged = "" if expected is None else f" (metrics.jsonl has {expected:.6g})"
    if not math.isfinite(loss):
        return None if streak else f"the first step after restoring it has loss {loss}{logged}"
    if expected is not None and math.isfinite(expected) and \
            abs(loss - expected) > LOSS_TOLERANCE * max(abs(expected), 1.0):
        return (f"the first step after restoring it has loss {loss:.6g}, but metrics.jsonl "
                f"has {expected:.6g} for step {step + 1} (a resume repeats it, within "
                f"{LOSS_TOLERANCE:.0%})")
    return None


class FirstStepCheck(Hook):
    """After the first step from a restored checkpoint: its loss, and the state it produced
    (see the module's docstring). Raises RestoreRejected for a damaged one; vouches for one
    that passed (its manifest, if it had none). First among the hooks: nothing is logged or
    saved from a state before it passed."""

    def __init__(self, restored, state: TrainState, shardings: TrainState,
                 expected: float | None):
        self.restored, self.shardings, self.expected = restored, shardings, expected
        self.streak = restored_streak(state)

    def after_step(self, info: StepInfo) -> None:
        if info.step != self.restored.step + 1:
            return
        loss = float(jax.device_get(info.metrics["loss"]))
        problem = first_loss_problem(loss, self.expected, self.restored.step, self.streak)
        if problem is None and (problem := state_problem(info.state, self.shardings)):
            problem = f"after the first step from it, {problem}"
        if problem is not None:
            raise RestoreRejected(self.restored, problem)
        self.restored.tier.vouch(self.restored.step)
