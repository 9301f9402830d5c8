"""Export: the newest checkpoint of a run -> a Hugging Face directory (commands/convert.py)."""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from tqdm import tqdm

from jaxtrain import inference
from jaxtrain.errors import ConfigError
from jaxtrain.hf import adapter as adapter_lib
from jaxtrain.hf import generation, layer_types, module_for
from jaxtrain.hf.files import SafetensorsWriter, parse_size
from jaxtrain.models import lora
from jaxtrain.train.setup import Setup
from jaxtrain.workdir import check_new_folder

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


def load_for_export(workdir, devices: Sequence[jax.Device] | None = None
                   ) -> tuple[Setup, dict, int]:
    """(setup, params, step) of the newest intact checkpoint in `workdir`, params only (no
    optimizer state), on a mesh of this process's devices: FSDP over all of them where
    model.d_model divides, else one device. The config is the one saved with that step."""
    devices = list(devices if devices is not None else jax.local_devices())
    _, cfg = inference.run_config(workdir)
    fsdp = len(devices) if cfg.model.d_model % len(devices) == 0 else 1
    loaded = inference.load(workdir, fsdp=fsdp, batch=fsdp, devices=devices)
    return loaded.setup, loaded.params, loaded.step


def export_hf(workdir, out_dir, max_shard_size: str | int = "2GB", dtype: str = "float32",
              devices: Sequence[jax.Device] | None = None, adapter: bool = False
              ) -> list[str]:
    """Exports the newest checkpoint of run `workdir` to HF `out_dir`; returns the files.
    A LoRA run exports its base with the adapters folded in (W + scale·A@B), or with
    `adapter` the adapters alone in PEFT's format (hf/adapter.py).

    Streams: one parameter (one layer of a stacked one) at a time comes to the host, is
    laid out as HF keeps it and goes into the shard being filled; a shard is written once
    full. Peak host memory is one shard (max_shard_size, or one tensor if larger) plus the
    tensor being converted.
    """
    out_dir = pathlib.Path(out_dir)
    max_bytes = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    _check_request(workdir, out_dir, dtype, adapter)
    setup, params, step = load_for_export(workdir, devices)
    spec = setup.spec
    # An adapter is loaded onto the HF export of its base: that base must be exportable too.
    _check_exportable(spec if spec.lora is None else lora.base_spec(spec), module_for(spec))
    if adapter:
        return adapter_lib.export_adapter(setup, params, step, workdir, out_dir, DTYPES[dtype])
    if spec.lora is not None:
        params, spec = lora.merged(spec, params), lora.base_spec(spec)
    family = module_for(spec)
    hf_config = {**family.export_config(spec), "torch_dtype": dtype}
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _write_tensors(out_dir, max_bytes, traverse_util.flatten_dict(params),
                           _tensor_order(spec, family.tensors(spec)), DTYPES[dtype])
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    files += _write_generation_config(workdir, setup.cfg, out_dir)
    print(f"jaxtrain: exported step {step} of {workdir} ({spec.family} {spec.num_layers}x"
          f"{spec.d_model}, {dtype}) to {out_dir}: config.json, {', '.join(files)}",
          file=sys.stderr)
    return ["config.json", *files]


def _write_generation_config(workdir, cfg, out_dir: pathlib.Path) -> list[str]:
    """The run's generation_config.json (a LoRA run without one: its base's), as imported."""
    text = generation.text(workdir)
    if text is None and cfg.model.lora.base:
        text = generation.text(cfg.model.lora.base)
    if text is None:
        return []
    (out_dir / generation.FILE).write_text(text)
    return [generation.FILE]


def _check_request(workdir, out_dir: pathlib.Path, dtype: str, adapter: bool) -> None:
    """ConfigError (one line) before anything is loaded: the dtype, a new or empty directory,
    --adapter of a LoRA run."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is invalid: valid values are "
                          f"{', '.join(DTYPES)}")
    check_new_folder(out_dir, "--to-hf")  # any file there (a lone tokenizer.json) counts
    if adapter and inference.run_config(workdir)[1].model.lora.rank == 0:
        raise ConfigError(f"--adapter: {workdir} is no LoRA run (model.lora.rank=0); export "
                          "without --adapter")


def _check_exportable(spec, family) -> None:
    """ConfigError for a model the Hugging Face family cannot express."""
    windows = layer_types.windows(spec)
    if not getattr(family, "LAYER_TYPES", False) and len(set(windows)) > 1:
        raise ConfigError(f"model.layer_types={','.join(spec.layer_types)!r} cannot be "
                          f"exported: HF {spec.family} has one window for every layer")
    if not family.SLIDING_WINDOW and any(w and w < spec.seq_len for w in windows):
        raise ConfigError(f"model.sliding_window={spec.sliding_window} cannot be exported: "
                          f"HF {spec.family} attends to every earlier token (a window exports "
                          "as model.family='mistral', or a llama with model.moe)")
    if getattr(family, "MOE_LAYOUTS", False) and spec.moe is not None \
            and spec.moe.shared_experts and not getattr(family, "SHARED_EXPERTS", False):
        raise ConfigError(f"model.moe.shared_experts={spec.moe.shared_experts} cannot be "
                          f"exported: {family.ARCHITECTURE} has no shared experts")
    if getattr(family, "MOE_LAYOUTS", False):
        return
    if spec.moe is not None and (spec.moe.every_n_layers != 1 or spec.moe.shared_experts):
        raise ConfigError("an MoE model exports as MixtralForCausalLM, whose layers are all "
                          "MoE without shared experts: model.moe.every_n_layers="
                          f"{spec.moe.every_n_layers}, shared_experts="
                          f"{spec.moe.shared_experts} cannot be exported")


def _tensor_order(spec, tensors) -> list[tuple]:
    """(tensor, layer, expert) in HF's file order: the tensors before the layers, each
    layer's (each expert's), then the rest."""
    first = next(i for i, t in enumerate(tensors) if t.per_layer)
    layered = [t for t in tensors if t.per_layer]
    return ([(t, None, None) for t in tensors[:first]]
            + [(t, i, e) for i in range(spec.num_layers) for t in layered
               if t.layers is None or i in t.layers
               for e in (range(t.experts) if t.experts else [None])]
            + [(t, None, None) for t in tensors[first:] if not t.per_layer])


def _write_tensors(out_dir: pathlib.Path, max_bytes: int, flat: dict, order: list[tuple],
                   dtype) -> list[str]:
    """Each tensor fetched to the host (one layer, one expert at a time), laid out as HF
    keeps it and added to the shard being filled; returns the shard files."""
    def fetch(path, layer, expert) -> np.ndarray:
        # A stored weight (a LoRA run's int8/nf4/bf16 base, lora.merged) is sliced to its
        # layer as stored, then read back (and its adapter folded) one layer at a time.
        value = flat[path] if layer is None else jax.tree.map(lambda x: x[layer], flat[path])
        value = lora.plain(value)
        return np.asarray(jax.device_get(value if expert is None else value[expert]))

    writer = SafetensorsWriter(out_dir, max_bytes)
    for tensor, layer, expert in tqdm(order, desc="export", unit="tensor", file=sys.stderr):
        index = layer if tensor.layers is None or layer is None else tensor.layers.index(layer)
        pieces = [part.to_hf(fetch(part.path, index, expert)) for part in tensor.parts]
        value = tensor.join(pieces)
        name = tensor.named(layer, expert)
        assert value.shape == tensor.shape, (name, value.shape, tensor.shape)
        writer.add(name, value.astype(dtype))
    return writer.close()
