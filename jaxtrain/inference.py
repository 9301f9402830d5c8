"""A trained model, loaded for use: the run's config and its parameters on a mesh, and
its loss on held-out text.

Generation, evaluation, quantization and export all start here. The mesh is chosen for the
job, not copied from training: the parameters are stored layout-free (orbax reshards), so a
model trained on a data × fsdp × pipeline mesh loads onto one device, or onto a tensor-parallel
mesh that keeps each device's share of the weights, never gathering the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx

from jaxtrain import quantization as quantization_lib
from jaxtrain import storage
from jaxtrain.checkpoint import Checkpoints
from jaxtrain.config import base_config
from jaxtrain.data import record
from jaxtrain.data.batches import to_global
from jaxtrain.data.packing import Packed, batch_targets
from jaxtrain.data.sources import SOURCES, TokenWindows
from jaxtrain.errors import CheckpointError, ConfigError, DataError
from jaxtrain.scoring import Scorer
from jaxtrain.tasks.harness import lm_class
from jaxtrain.tasks.text import run_tokenizer
from jaxtrain.train import frozen
from jaxtrain.train.setup import Setup, build
from jaxtrain.train.state import BASE, abstract_model, param_axes, param_shardings
from jaxtrain.train.step import loss_fn
from jaxtrain.workdir import CHECKPOINTS, QUANTIZATION_FILE


@dataclasses.dataclass
class LoadedModel:
    cfg: ml_collections.ConfigDict
    setup: Setup
    params: dict
    step: int
    quantization: dict | None = None  # quantize.py's record, for an int8 model

    def loss_step(self):
        """jit((params, tokens) -> mean loss). The parameters keep the shardings they were
        loaded with (an int8 weight is several arrays, so no one sharding per weight)."""
        graphdef = self.setup.graphdef
        return jax.jit(lambda params, tokens_BT: loss_fn(params, graphdef, tokens_BT))


def run_config(workdir: pathlib.Path) -> tuple[int, ml_collections.ConfigDict]:
    """(step, config) of a run's newest intact checkpoint."""
    workdir = storage.as_path(workdir, "--workdir")
    directory = workdir / CHECKPOINTS
    if not directory.is_dir():
        raise CheckpointError(f"--workdir={workdir} holds no checkpoints/ directory: "
                              "train with jaxtrain train (python -m jaxtrain.main) first")
    checkpoints = Checkpoints(directory, keep=1_000_000, log=lambda _: None, read_only=True)
    try:
        step, saved = checkpoints.latest_intact()
    finally:
        checkpoints.close()
    cfg = base_config()  # keys added since the run was saved keep their defaults
    cfg.update(saved)
    cfg.mesh.rules = tuple(tuple(rule) for rule in cfg.mesh.rules)  # JSON made them lists
    return step, cfg


def load(workdir, *, data: int = 1, fsdp: int = 1, tensor: int = 1, batch: int | None = None,
         devices: Sequence[jax.Device] | None = None) -> LoadedModel:
    """The newest intact checkpoint of a run (or a quantized model directory) on a
    data × fsdp × tensor mesh of the first data·fsdp·tensor devices; `batch` replaces the
    run's train.global_batch (the rows an evaluation batch holds; data·fsdp must divide it)."""
    workdir = storage.as_path(workdir, "--workdir")
    step, cfg = run_config(workdir)
    cfg.mesh.update(data=data, pipeline=1, fsdp=fsdp, tensor=tensor, expert=1, context=1,
                    dcn_data=1, dcn_pipeline=1, dcn_fsdp=1, dcn_tensor=1, dcn_expert=1,
                    dcn_context=1, sequence_parallel=False)
    cfg.train.microbatches = 1
    if batch is not None:
        cfg.train.global_batch = batch
    cfg.optimizer.offload_to_host = False
    devices = list(devices if devices is not None else jax.devices())[:data * fsdp * tensor]
    setup = build(cfg, devices)
    target = setup.abstract_state().params
    quantization = _quantization(workdir)
    if quantization is not None:
        # A quantized LoRA model holds its base too (quantize.py saves the whole model), its
        # matmuls int8 whatever model.lora.base_dtype it trained on: the float model's tree
        # (a stored base's NF4/bf16 weights are no arrays to restore into).
        model = abstract_model(setup.spec)
        shardings = param_shardings(model, setup.mesh, setup.spec.rules)
        target = jax.tree.map(
            lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
            nnx.to_pure_dict(nnx.state(model, nnx.Param)), shardings)
        axes_by_path = param_axes(model)
        target = quantization_lib.abstract_quantized(target, axes_by_path)
    params = _restore(workdir, step, setup, target, adapters=quantization is None)
    if quantization is not None:
        params = quantization_lib.from_dicts(params, quantization["int8_activations"],
                                             quantization_lib.quantized_paths(axes_by_path))
    return LoadedModel(cfg=cfg, setup=setup, params=params, step=step,
                       quantization=quantization)


def _restore(workdir, step: int, setup: Setup, target: dict, adapters: bool) -> dict:
    """The parameters of `step` into `target`; `adapters` (a LoRA run, not a quantized
    model directory): joined to the base they were trained on, refused for another
    (train/frozen.py on_base, against the fingerprint the checkpoint holds)."""
    items = {"params": target}
    lora_run = adapters and setup.spec.lora is not None
    if lora_run:
        items["base_fingerprint"] = jax.ShapeDtypeStruct(
            (8,), np.uint32, sharding=setup.shardings.frozen[BASE].fingerprint)
    checkpoints = Checkpoints(workdir / CHECKPOINTS, keep=1_000_000, log=lambda _: None,
                              read_only=True)
    try:
        restored = checkpoints.restore_items(step, items)
    finally:
        checkpoints.close()
    if not lora_run:
        return restored["params"]
    return frozen.on_base(setup.cfg, setup.spec, setup.shardings.frozen[BASE].params,
                          restored["params"], restored["base_fingerprint"])


def task_scorer(workdir, *, data: int = 1, fsdp: int = 1, tensor: int = 1, batch: int = 8,
                devices: Sequence[jax.Device] | None = None,
                progress: bool = True) -> tuple[Scorer, LoadedModel]:
    """The newest checkpoint of a run as a scorer for task evaluation (jaxtrain/scoring.py)
    on a data × fsdp × tensor mesh, `batch` rows per scoring batch."""
    shards = data * fsdp
    loaded = load(workdir, data=data, fsdp=fsdp, tensor=tensor, devices=devices,
                  batch=-(-batch // shards) * shards)
    return Scorer.from_setup(loaded.setup, batch, loaded.params, progress), loaded


def task_model(workdir, **kwargs):
    """The newest checkpoint of a run as an lm_eval model, with the run's tokenizer:
    `lm_eval.simple_evaluate(model=inference.task_model(RUN, tensor=2), tasks=[...])`.
    Takes task_scorer's keywords."""
    scorer, loaded = task_scorer(workdir, **kwargs)
    return lm_class()(scorer=scorer, tokenizer=run_tokenizer(loaded.cfg, workdir))


def _quantization(workdir: pathlib.Path) -> dict | None:
    path = workdir / QUANTIZATION_FILE
    return json.loads(path.read_text()) if path.exists() else None


def prompt_tokens(cfg, text: str | None, ids: list[str] | None,
                  max_new_tokens: int = 0, tokenizer=None) -> list[int]:
    """The prompt as token ids; ConfigError (one line) for what this model cannot take.
    Text is encoded with `tokenizer`, the run's (data/record.py run_tokenizer): without one
    there is no text, whatever the data source, since an import may have ids of its own."""
    if (text is None) == (ids is None):
        raise ConfigError("give exactly one of --prompt and --prompt_ids")
    if text is not None:
        if tokenizer is None:
            raise ConfigError(f"--prompt needs the model's tokenizer, and this run has none "
                              f"(data.source={cfg.data.source!r}); pass --prompt_ids")
        tokens = tokenizer.encode(text)
    else:
        try:
            tokens = [int(i) for i in ids]
        except ValueError:
            raise ConfigError(f"--prompt_ids={','.join(ids)} is invalid: integers, "
                              "comma-separated") from None
    bad = [t for t in tokens if not 0 <= t < cfg.model.vocab_size]
    if not tokens or bad:
        raise ConfigError(f"the prompt must be 1 or more token ids in [0, "
                          f"{cfg.model.vocab_size}); got {bad or 'none'}")
    limit = cfg.model.seq_len
    if len(tokens) >= limit:
        raise ConfigError(f"the prompt is {len(tokens)} tokens: it must be shorter than the "
                          f"model's model.seq_len={limit}, to leave room for new tokens")
    if len(tokens) + max_new_tokens > limit:
        raise ConfigError(f"--max_new_tokens={max_new_tokens} is too many: the prompt "
                          f"({len(tokens)} tokens) plus new tokens must fit the model's "
                          f"model.seq_len={limit}; at most {limit - len(tokens)}")
    return tokens


def decode_text(tokenizer, ids: Sequence[int]) -> tuple[str | None, str | None]:
    """(text, None) of token ids; (None, why) where the tokenizer does not cover an id (bytes
    cannot decode 300; tokenizers' decode would silently drop it); (None, None) without a
    tokenizer: the ids are the output."""
    if tokenizer is None:
        return None, None
    outside = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if outside:
        return None, (f"id {outside[0]} is outside the run's tokenizer "
                      f"({tokenizer.describe()}): ids only, no text")
    return tokenizer.decode(ids), None


def _validation_windows(cfg, tokenizer):
    """(windows, their tokenizer) of the run's validation split; DataError where the split's
    ids are another tokenizer's than the run's (e.g. an import with its own tokenizer under
    a config on the byte corpus): the loss would be of ids that mean other text."""
    source = SOURCES[cfg.data.source]
    if not source.validation_text:
        raise DataError(f"this run trained on data.source={cfg.data.source!r}: it has no "
                        "validation text; pass --data")
    made_by = record.data_tokenizer(cfg)
    if tokenizer is not None and made_by is not None \
            and made_by.fingerprint() != tokenizer.fingerprint():
        raise DataError(f"the validation split's ids are {made_by.describe()} (data.source="
                        f"{cfg.data.source!r}), but the run's tokenizer is "
                        f"{tokenizer.describe()}: they would mean other text; pass --data")
    if source.tokens is None:  # e.g. prepared datasets: the loop's validation windows
        return source.splits(cfg)[1], made_by or tokenizer
    return TokenWindows(source.tokens(cfg)[1], cfg.model.seq_len, "the validation split"), \
        made_by or tokenizer


def evaluation_windows(cfg, data: str | None, tokenizer=None):
    """(name, windows source, the tokenizer of their ids or None) for the run's validation
    split or a file; `tokenizer` is the run's: a .bin holds its ids, a text file is encoded
    with it (and needs one)."""
    if data is None:
        return ("validation split", *_validation_windows(cfg, tokenizer))
    path = pathlib.Path(data)
    if not path.is_file():
        raise DataError(f"--data={data}: no such file")
    if path.suffix == ".bin":
        tokens = np.fromfile(path, dtype=cfg.data.dtype)
        top = int(tokens.max()) if len(tokens) else 0
        if top >= cfg.model.vocab_size:
            raise DataError(f"--data={data} holds token id {top}, outside the model's "
                            f"vocabulary of {cfg.model.vocab_size}")
    elif tokenizer is None:
        raise DataError(f"--data={data} is text and this run has no tokenizer (data.source="
                        f"{cfg.data.source!r}); pass a .bin token file")
    elif tokenizer.kind == "bytes":  # the file's own bytes, invalid UTF-8 included
        tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    else:
        tokens = np.asarray(tokenizer.encode(path.read_text(errors="replace")), dtype=np.int32)
    return str(path), TokenWindows(tokens, cfg.model.seq_len, f"--data={data}"), tokenizer


def evaluate(loaded, windows, batches: int) -> dict:
    """Mean next-token loss over `batches` batches of consecutive windows (or packed rows:
    over their counted targets, each batch weighted by its count)."""
    setup, rows = loaded.setup, loaded.cfg.train.global_batch
    eval_step = loaded.loss_step()
    losses, counts = [], []
    with jax.set_mesh(setup.mesh):
        for b in range(batches):
            batch = jax.tree.map(lambda *r: np.stack(r),
                                 *[windows[b * rows + i] for i in range(rows)])
            counts.append(int(batch_targets(batch).sum())
                          if isinstance(batch, Packed) else rows * loaded.cfg.model.seq_len)
            losses.append(eval_step(loaded.params, to_global(batch, setup.tokens_sharding)))
    losses = jax.device_get(losses)
    loss = float(np.average(losses, weights=counts) if isinstance(batch, Packed)
                 else np.mean(losses))
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_token": loss / math.log(2),
            "tokens": int(sum(counts))}
