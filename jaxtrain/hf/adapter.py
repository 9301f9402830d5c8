"""A LoRA run's adapters in PEFT's format (adapter_config.json, adapter_model.safetensors),
for `peft.PeftModel.from_pretrained(<the HF export of the base>, OUT)`.

PEFT keeps, per adapted torch Linear [out, in], `lora_A.weight` [r, in] and `lora_B.weight`
[out, r] under `base_model.model.<the module's name>`, and scales B·A by lora_alpha/r, as
jaxtrain does (models/lora.py). jaxtrain's A is [in..., r] and B [r, out...]: flattened in
the same order as the weight's HF layout (hf/llama.py: no permutation), then transposed.
Only separate projections map (HF modules with PEFT_LAYOUT: the Llama-like ones; GPT-2
fuses q, k and v into one c_attn);
the routed experts of an MoE model have no PEFT module (transformers 5 keeps Mixtral's
experts as fused 3-D parameters), and PEFT moves an MoE model's gate/up/down_proj adapters
onto those experts: all three are refused in one line; export merged instead. A stack's
entries are mapped to the model's layers they hold (an interleaved MoE model keeps its
dense and MoE layers in two stacks).
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from jaxtrain.errors import ConfigError
from jaxtrain.hf import module_for
from jaxtrain.models.lora import PREFIX, TARGETS, split
from jaxtrain.models.stack import Groups

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MODULES = {"attention": "self_attn", "mlp": "mlp"}  # jaxtrain module kind -> HF's


def check(spec) -> None:
    """ConfigError when PEFT could not load this run's adapters."""
    if not getattr(module_for(spec), "PEFT_LAYOUT", False):
        raise ConfigError(f"--adapter: a model.family={spec.family!r} adapter has no PEFT "
                          "layout (GPT-2 fuses q, k, v in c_attn); export the merged weights "
                          "(without --adapter)")
    if "experts" in spec.lora.targets:
        raise ConfigError("--adapter: PEFT has no module for the routed experts "
                          "(model.lora.targets has experts); export the merged weights "
                          "(without --adapter)")
    dense_mlp = sorted(set(spec.lora.targets) & {"gate", "up", "down"})
    if spec.moe is not None and dense_mlp:
        # PEFT (0.21, on transformers 5) reads gate_proj/up_proj/down_proj in an MoE model's
        # adapter as the pre-v5 experts' names and moves them onto the fused experts, so a
        # dense layer's MLP adapter would load onto the experts.
        raise ConfigError(f"--adapter: PEFT reads the MLP targets {','.join(dense_mlp)} of an "
                          "MoE model as its experts' (model.lora.targets="
                          f"{','.join(spec.lora.targets)}); target q,k,v,o or export the merged "
                          "weights (without --adapter)")


def tensors(spec, adapters: dict) -> dict[str, np.ndarray]:
    """PEFT's key -> array of every adapter of every layer (a stack's i-th entry is the
    model's layer `layers[stack][i]`: the dense and MoE layers of an interleaved model, e.g.
    Qwen3-MoE's decoder_sparse_step, live in two stacks)."""
    out = {}
    flat = traverse_util.flatten_dict(adapters, is_leaf=lambda _, x: isinstance(x, dict)
                                      and set(x) == {"a", "b"})
    for path, pair in flat.items():
        stack, module, name = path[0], path[-2], path[-1][len(PREFIX):]
        hf_module = MODULES["attention" if module == "attn" else "mlp"]
        target = next(t for t in TARGETS.values() if t.module in ("attention", "mlp")
                      and f"w_{name}" in t.weights)
        assert stack in ("blocks", "moe_blocks"), path
        a, b = np.asarray(jax.device_get(pair["a"])), np.asarray(jax.device_get(pair["b"]))
        rank = a.shape[-1]
        for i, layer in enumerate(_layers(spec, stack, a.shape[0])):
            key = f"base_model.model.model.layers.{layer}.{hf_module}.{target.peft}"
            out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
            out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
    return out


def _layers(spec, stack: str, count: int):
    """The model's layers that a stack's `count` entries hold, in order."""
    if spec is None or spec.moe is None:
        return range(count)
    moe_L = Groups.of(spec).moe_layers()
    return np.flatnonzero(moe_L if stack == "moe_blocks" else ~moe_L)


def adapter_config(spec, base: str) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.lora.rank,
            "lora_alpha": spec.lora.alpha, "lora_dropout": 0.0,
            "target_modules": sorted(TARGETS[t].peft for t in spec.lora.targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "modules_to_save": None,
            "base_model_name_or_path": base, "inference_mode": True}


def export_adapter(setup, params: dict, step: int, workdir, out_dir, dtype) -> list[str]:
    """Writes the adapter of `params` (the model's whole tree) into `out_dir`."""
    spec = setup.spec
    check(spec)
    out_dir = pathlib.Path(out_dir)
    if (out_dir / CONFIG_FILE).exists() or (out_dir / WEIGHTS_FILE).exists():
        raise ConfigError(f"--to-hf={out_dir} already holds an adapter; export into a new "
                          "or empty directory")
    adapters = split(params)[0]
    arrays = {k: v.astype(dtype) for k, v in tensors(spec, adapters).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(spec, str(setup.cfg.model.lora.base))
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    print(f"jaxtrain: exported the LoRA adapter of step {step} of {workdir} (rank "
          f"{spec.lora.rank}, {', '.join(config['target_modules'])}; {len(arrays)} tensors) "
          f"to {out_dir}: {CONFIG_FILE}, {WEIGHTS_FILE}", file=sys.stderr)
    return [CONFIG_FILE, WEIGHTS_FILE]
