"""jaxtrain quantize --workdir RUN --out DIR [--calibration_batches N]
    [--int8_activations] [--devices N]

Post-training INT8 quantization of a run's newest checkpoint: every matmul weight and the
embedding table become int8 with one float32 scale per output channel (models/int8.py);
norms, biases and learned positions stay float32. With --int8_activations the block matmuls
also take int8 inputs, each with a per-tensor scale calibrated as the input's absolute
maximum over N training batches. DIR is a model directory that `jaxtrain generate` and
`jaxtrain eval` read like a run; the float32 and int8 validation losses are measured and
printed (one JSON line) with the sizes.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from absl import flags, logging

from jaxtrain import inference, storage
from jaxtrain.checkpoint import Checkpoints
from jaxtrain.commands.common import run_absl
from jaxtrain.data import make_batches
from jaxtrain.data import record as data_record
from jaxtrain.errors import ConfigError
from jaxtrain.quantization import as_dicts, calibrate, directory_bytes, quantize_params
from jaxtrain.train.state import TrainState, abstract_model, param_axes
from jaxtrain.workdir import CHECKPOINTS, write_config


def _define_flags() -> dict:
    values = {
        "workdir": flags.DEFINE_string("workdir", None, "The run to quantize."),
        "out": flags.DEFINE_string("out", None, "Directory for the quantized model."),
        "calibration_batches": flags.DEFINE_integer(
            "calibration_batches", 8, "Training batches that calibrate the activation scales."),
        "int8_activations": flags.DEFINE_bool(
            "int8_activations", False, "int8 inputs to the block matmuls too (calibrated), "
            "not only int8 weights."),
        "devices": flags.DEFINE_integer("devices", 1, "Devices to spread the batches over."),
    }
    flags.mark_flags_as_required(["workdir", "out"])
    return values


def quantize_run(workdir, out, calibration_batches: int = 8, int8_activations: bool = False,
                 devices: int = 1) -> dict:
    """Quantizes the newest checkpoint of `workdir` into model directory `out`; returns the
    summary (sizes, float32 and int8 validation losses). Raises ConfigError, CheckpointError
    or DataError (one line) for bad input, before writing anything."""

    out = storage.as_path(out, "--out")
    if (out / CHECKPOINTS).exists():
        raise ConfigError(f"--out={out} already holds a model; choose a new directory")
    if calibration_batches < 1:
        raise ConfigError(f"--calibration_batches={calibration_batches} is invalid: >= 1")
    step, cfg = inference.run_config(workdir)
    tokenizer = data_record.run_tokenizer(workdir, cfg)  # its package, before any writing
    loaded = inference.load(workdir, data=devices, batch=cfg.train.global_batch)
    _, windows, _ = inference.evaluation_windows(loaded.cfg, None)
    axes_by_path = param_axes(abstract_model(loaded.setup.spec))
    act_absmax = None
    if int8_activations:
        train = make_batches(loaded.cfg).train_iter(0)
        act_absmax = calibrate(loaded, axes_by_path,
                               [next(train) for _ in range(calibration_batches)])
    float_result = inference.evaluate(loaded, windows, loaded.cfg.eval_batches)
    float_bytes = sum(x.nbytes for x in jax.tree.leaves(loaded.params))
    loaded.params = quantize_params(loaded.params, axes_by_path, act_absmax)
    loaded.quantization = {"bits": 8, "int8_activations": bool(act_absmax)}
    int8_result = inference.evaluate(loaded, windows, loaded.cfg.eval_batches)

    checkpoints = Checkpoints(out / CHECKPOINTS, keep=1, log=lambda _: None)
    state = TrainState(step=jnp.asarray(step, jnp.int32), params=as_dicts(loaded.params),
                       opt_state={})
    checkpoints.save(step, state.tree(), loaded.cfg.to_dict())
    checkpoints.close()
    record = {**loaded.quantization, "source": str(workdir), "step": step,
              "calibration_batches": calibration_batches if act_absmax else 0,
              "float32_val_loss": float_result["loss"], "int8_val_loss": int8_result["loss"]}
    storage.write_json(out / inference.QUANTIZATION_FILE, record, indent=2)
    write_config(out, loaded.cfg)
    # generate and eval read the model directory like a run (None: it records that there is
    # no tokenizer, so that none is assumed there either).
    data_record.store_tokenizer(out, tokenizer)
    int8_bytes = directory_bytes(out / CHECKPOINTS)
    return {**record, "out": str(out), "float32_param_bytes": float_bytes,
            "int8_checkpoint_bytes": int8_bytes, "size_ratio": round(int8_bytes / float_bytes, 4),
            "val_loss_change": int8_result["loss"] / float_result["loss"] - 1}


def _quantize(f: dict, argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    summary = quantize_run(f["workdir"].value, f["out"].value, f["calibration_batches"].value,
                           f["int8_activations"].value, f["devices"].value)
    print(json.dumps(summary))


def main(argv: list[str] | None = None) -> None:
    values = _define_flags()
    run_absl("quantize", lambda args: _quantize(values, args), argv,
             paths=("workdir", "out"))


if __name__ == "__main__":
    main()
