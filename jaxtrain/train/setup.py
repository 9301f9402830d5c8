"""Everything a run builds from its config before the first step, built once.

The loop, the benchmark, the planner and the tests all start from here, so a model, its
mesh and its jitted step are put together the same way everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxtrain.config import validate
from jaxtrain.data.layouts import LAYOUTS
from jaxtrain.mesh import dcn_shape, make_mesh
from jaxtrain.models import ModelSpec, lora
from jaxtrain.models.router import bias_update
from jaxtrain.objectives import OBJECTIVES, Objective, document_masks, rollout_shardings
from jaxtrain.optim import make_optimizer
from jaxtrain.precision import PRECISIONS
from jaxtrain.train import frozen
from jaxtrain.train import state as state_lib
from jaxtrain.train.faults import loss_with_faults
from jaxtrain.train.step import (
    StepOptions,
    batch_sharding,
    iterated_step,
    jit_eval_step,
    jit_train_step,
    make_train_step,
)


@dataclasses.dataclass(frozen=True)
class Setup:
    cfg: object
    mesh: Mesh
    spec: ModelSpec
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    graphdef: nnx.GraphDef
    shardings: state_lib.TrainState
    tokens_sharding: NamedSharding

    def init_state(self) -> state_lib.TrainState:
        """A fresh train state, born in its shards (LoRA: with its frozen base loaded)."""
        state = state_lib.init_state(self.spec, self.optimizer, self.shardings, self.cfg.seed,
                                     loss_scale_init(self.cfg))
        return self.with_base(state, fresh=True)

    def with_base(self, state: state_lib.TrainState, fresh: bool) -> state_lib.TrainState:
        """The state with its frozen models loaded (train/frozen.py: a LoRA state's base, a
        DPO state's reference without LoRA, from which a fresh one starts); a restored
        state must have the ones it was trained with. Any other as it is."""
        return frozen.attach(state, self.cfg, self.spec, self.shardings, fresh)

    @property
    def objective(self) -> Objective:
        """The train.objective entry (objectives.py)."""
        return OBJECTIVES[self.cfg.train.objective]

    @property
    def model_shardings(self) -> dict:
        """Shardings of every model parameter (LoRA: the base's and the adapters')."""
        return self.shardings.model_params()

    @property
    def base_graphdef(self) -> nnx.GraphDef:
        """The model without adapters: nnx.merge(base_graphdef, state.frozen_params("base"))
        is LoRA's base
        (a reference model without a second copy of the weights); without LoRA, graphdef."""
        return nnx.graphdef(state_lib.abstract_model(lora.base_spec(self.spec)))

    def abstract_state(self) -> state_lib.TrainState:
        """Shapes, dtypes and shardings of the state, for restoring a checkpoint into."""
        return state_lib.abstract_state(self.spec, self.optimizer, self.shardings,
                                        loss_scale_init(self.cfg))

    def abstract_step_state(self) -> state_lib.TrainState:
        """Shapes, dtypes and shardings of all the step takes, frozen parameters included
        (an ahead-of-time compile)."""
        return state_lib.abstract_step_state(self.spec, self.optimizer, self.shardings,
                                             loss_scale_init(self.cfg))

    def train_step(self) -> Callable:
        """jit(train_step) with explicit shardings and donated state; call under the mesh."""
        cfg = self.cfg
        options = StepOptions(
            microbatches=cfg.train.microbatches, loss_scale_period=cfg.train.loss_scale_period,
            constants=() if self.spec.pipeline is None else (
                ("pipeline_bubble", self.spec.pipeline.bubble),),
            opt_device_shardings=(state_lib.on_device(self.shardings.opt_state)
                                  if cfg.optimizer.offload_to_host else None),
            weight_by_targets=self.objective.weighting == "targets",
            after_update=bias_update(self.spec))
        loss = loss_with_faults(self.losses()[0], cfg.debug)
        step = make_train_step(loss, self.optimizer, self.schedule, self.spec.rules, options)
        if self.objective.rollouts and cfg.train.grpo.num_iterations > 1:
            step = iterated_step(step, self.graphdef, cfg.train.grpo.num_iterations,
                                 float(cfg.train.grpo.temperature))
        return jit_train_step(step, self.shardings, self.batch_shardings)

    @property
    def batch_shardings(self):
        """The step's batch sharding: the token sharding (every array of a Packed batch),
        or an objective's Rollouts' (objectives.rollout_shardings)."""
        if self.objective.rollouts:
            return rollout_shardings(self.tokens_sharding)
        return self.tokens_sharding

    def losses(self) -> tuple[Callable, Callable]:
        """(the loss the step differentiates, the eval loss) of train.objective."""
        return self.objective.losses(self.graphdef, self.base_graphdef, self.cfg)

    def abstract_batch(self):
        """Shapes, dtype and sharding of one global batch: a token array [B, seq_len + 1],
        or a Packed batch of such arrays, as the batch layout (data.packing) says."""
        rows = jax.ShapeDtypeStruct((self.cfg.train.global_batch, self.cfg.model.seq_len + 1),
                                    jnp.int32, sharding=self.tokens_sharding)
        return LAYOUTS[self.cfg.data.packing].batch(rows)

    @property
    def reference_forwards(self) -> int:
        """Forward passes of a frozen reference per step (MFU counts them): the
        objective's, where this run has a reference (GRPO: beta > 0)."""
        return self.objective.reference_forwards * self.objective.with_reference(self.cfg)

    @property
    def uses_reference(self) -> bool:
        """Whether the objective runs a reference model (the eval step then takes the
        state's reference parameters: TrainState.reference_params)."""
        return self.reference_forwards > 0

    def eval_step(self) -> Callable:
        """jit(eval)(params, tokens) -> the objective's sums over a batch and its units
        (train/evaluation.py weighs batches by them); (params, tokens, reference) when it
        runs a reference (uses_reference)."""
        references = self.shardings.reference_params() if self.uses_reference else None
        return jit_eval_step(self.graphdef, self.model_shardings, self.tokens_sharding,
                             self.losses()[1], references)


def loss_scale_init(cfg) -> float | None:
    """The initial dynamic loss scale: float16 compute only."""
    return cfg.train.loss_scale_init if PRECISIONS[cfg.train.precision].loss_scaling else None


def holds_reference(cfg, spec: ModelSpec) -> bool:
    """Whether the state holds a reference copy of the parameters: an objective that
    needs one, without LoRA (whose frozen base is the reference)."""
    objective = OBJECTIVES[cfg.train.objective]
    return objective.holds_reference and spec.lora is None and objective.with_reference(cfg)


def build(cfg, devices: Sequence[jax.Device] | None = None) -> Setup:
    """Validates cfg against the devices (default: all) and builds the run's pieces."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = validate(cfg, len(devices), devices[0].platform)
    mesh = make_mesh(sizes, devices, dcn_shape(cfg.mesh))
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes["pipeline"],
                                 platform=devices[0].platform, context=sizes["context"],
                                 segments=document_masks(cfg))
    optimizer, schedule = make_optimizer(cfg)
    return Setup(cfg=cfg, mesh=mesh, spec=spec, optimizer=optimizer, schedule=schedule,
                 graphdef=nnx.graphdef(state_lib.abstract_model(spec)),
                 shardings=state_lib.state_shardings(
                     spec, optimizer, mesh, loss_scale_init(cfg),
                     cfg.optimizer.offload_to_host,
                     reference=holds_reference(cfg, spec)),
                 tokens_sharding=batch_sharding(mesh, spec.rules))
