"""Rematerialisation policies: one registry entry per `model.remat` value.

Each entry says what the forward pass keeps for the backward pass (everything else is
recomputed), where it can run, and what the planner models it as.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from jaxtrain.models.attention import ATTENTION_DOT_NAMES
from jaxtrain.models.mlp import MLP_DOT_NAMES

# The weight matmuls run under a custom VJP (layers.dense) whose outputs the dot rule cannot
# see into, so the policies that keep matmul outputs also name them.
WEIGHT_DOT_NAMES = tuple(n for n in ATTENTION_DOT_NAMES if n != "attention_out") + MLP_DOT_NAMES
_p = jax.checkpoint_policies


@dataclasses.dataclass(frozen=True)
class Remat:
    name: str
    doc: str
    policy: Callable | None  # a jax.checkpoint policy for each layer; None: no remat
    platforms: tuple[str, ...] = ("cpu", "gpu", "tpu")
    why_platforms: str = ""  # the config error on other platforms
    # Planner facts: what stays in device memory per layer ("kept": the forward's matmul
    # outputs; "dots": the weight matmul outputs; "input": the layer input only), and what
    # the backward recomputes ("nothing", "attention_scores", "forward").
    saves: str = "kept"
    recomputes: str = "nothing"

    def problem(self, platform: str | None) -> str | None:
        if platform is not None and platform not in self.platforms:
            return self.why_platforms or f"it runs on {', '.join(self.platforms)} devices"
        return None


REMATS: dict[str, Remat] = {r.name: r for r in (
    Remat("none", "keep what the backward pass needs (norms recomputed from their input)",
          None),
    Remat("full", "keep only each layer's input; recompute the layer",
          _p.nothing_saveable, saves="input", recomputes="forward"),
    Remat("save_dots", "keep the weight matmul outputs; recompute the attention scores",
          _p.save_from_both_policies(_p.dots_with_no_batch_dims_saveable,
                                     _p.save_only_these_names(*WEIGHT_DOT_NAMES)),
          saves="dots", recomputes="attention_scores"),
    # The finer policies are planned as their nearest coarse one (docs/planner.md).
    Remat("save_dots_except_mlp", "keep the attention projections and output; recompute "
          "the (larger) MLP", _p.save_only_these_names(*ATTENTION_DOT_NAMES),
          saves="dots", recomputes="attention_scores"),
    Remat("save_attention_out", "keep only the attention kernel's output",
          _p.save_only_these_names("attention_out"), saves="input", recomputes="forward"),
    Remat("offload_dots", "every named matmul output, moved to pinned host memory between "
          "forward and backward",
          _p.save_and_offload_only_these_names(
              names_which_can_be_saved=[],
              names_which_can_be_offloaded=[*ATTENTION_DOT_NAMES, *MLP_DOT_NAMES],
              offload_src="device", offload_dst="pinned_host"),
          platforms=("gpu", "tpu"), saves="input",
          why_platforms="offloading to pinned host memory needs GPU or TPU devices; use "
                        "save_dots or full on CPU"),
)}
