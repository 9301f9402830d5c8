"""Everything a run builds from its config before the first step, built once.

The loop, the benchmark, the planner and the tests all start from here, so a model, its
mesh and its jitted step are put together the same way everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxtrain.config import ConfigError, dcn_shape, validate
from jaxtrain.mesh import make_mesh
from jaxtrain.models import ModelSpec
from jaxtrain.optim import make_optimizer
from jaxtrain.train import state as state_lib
from jaxtrain.train.step import batch_sharding, jit_eval_step, jit_train_step, make_train_step


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
        """A fresh train state, born in its shards."""
        return state_lib.init_state(self.spec, self.optimizer, self.shardings, self.cfg.seed,
                                    loss_scale_init(self.cfg))

    def abstract_state(self) -> state_lib.TrainState:
        """Shapes, dtypes and shardings of the state, for restoring a checkpoint into."""
        return state_lib.abstract_state(self.spec, self.optimizer, self.shardings,
                                        loss_scale_init(self.cfg))

    def train_step(self) -> Callable:
        """jit(train_step) with explicit shardings and donated state; call under the mesh."""
        debug = self.cfg.debug
        nan_steps = (debug.nan_from_step, debug.nan_steps) if debug.nan_from_step >= 0 else None
        constants = {} if self.spec.pipeline is None else {
            "pipeline_bubble": self.spec.pipeline.bubble}
        opt_on_device = (state_lib.on_device(self.shardings.opt_state)
                         if self.cfg.optimizer.offload_to_host else None)
        step = make_train_step(self.graphdef, self.optimizer, self.schedule,
                               self.cfg.train.microbatches, self.spec.rules, nan_steps,
                               constants, self.cfg.train.loss_scale_period, opt_on_device)
        return jit_train_step(step, self.shardings, self.tokens_sharding)

    def eval_step(self) -> Callable:
        return jit_eval_step(self.graphdef, self.shardings.params, self.tokens_sharding)


def loss_scale_init(cfg) -> float | None:
    """The initial dynamic loss scale: float16 compute only."""
    return cfg.train.loss_scale_init if cfg.train.precision == "float16" else None


def build(cfg, devices: Sequence[jax.Device] | None = None) -> Setup:
    """Validates cfg against the devices (default: all) and builds the run's pieces."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = validate(cfg, len(devices))
    if cfg.model.remat == "offload_dots" and devices[0].platform == "cpu":
        raise ConfigError("model.remat='offload_dots' is invalid: offloading to pinned host "
                          "memory needs GPU or TPU devices; use save_dots or full on CPU")
    platform = devices[0].platform
    splash = cfg.model.attention == "splash" or (cfg.model.attention == "pallas"
                                                 and platform == "tpu")
    if splash and platform == "gpu":
        raise ConfigError("model.attention='splash' is invalid: it is the TPU kernel; on "
                          "GPUs use pallas (Triton) or cudnn")
    if splash and cfg.model.seq_len % 128:
        raise ConfigError(f"model.seq_len={cfg.model.seq_len} is invalid with the splash "
                          "attention kernel (model.attention='pallas' on TPU, or 'splash'): "
                          "it tiles the sequence in blocks of 128")
    if cfg.model.attention == "pallas" and platform != "tpu" and cfg.model.sliding_window:
        raise ConfigError(f"model.sliding_window={cfg.model.sliding_window} is invalid with "
                          "model.attention='pallas': jax's Pallas GPU kernel has no window; "
                          "use cudnn or chunked")
    if cfg.model.attention == "cudnn" and devices[0].platform != "gpu":
        raise ConfigError(f"model.attention='cudnn' is invalid: cuDNN needs NVIDIA GPUs and "
                          f"this run has {devices[0].platform} devices; use xla or chunked")
    mesh = make_mesh(sizes, devices, dcn_shape(cfg.mesh))
    spec = ModelSpec.from_config(cfg, pipeline_stages=sizes["pipeline"],
                                 platform=devices[0].platform)
    optimizer, schedule = make_optimizer(cfg)
    return Setup(cfg=cfg, mesh=mesh, spec=spec, optimizer=optimizer, schedule=schedule,
                 graphdef=nnx.graphdef(state_lib.abstract_model(spec)),
                 shardings=state_lib.state_shardings(spec, optimizer, mesh,
                                                     loss_scale_init(cfg),
                                                     cfg.optimizer.offload_to_host),
                 tokens_sharding=batch_sharding(mesh, spec.rules))
