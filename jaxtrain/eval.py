"""python -m jaxtrain.eval --workdir RUN [--data FILE] [--batches N] [--devices N]

Loss, perplexity and bits per token/byte of a run's newest checkpoint (or a quantized model
directory) as one JSON line: on the run's validation split by default, or on a token file
(`.bin`, in the run's data.dtype) or, for byte-level models, a text file (any other name).
Bits per byte are reported where a token is a byte; for other models pass
--bytes_per_token (the tokenizer's average on that text) to get them.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "A run directory, or a quantized model's.")
_DATA = flags.DEFINE_string("data", None, "A token file (.bin) or text file; default: the "
                            "run's validation split.")
_BATCHES = flags.DEFINE_integer("batches", None, "Batches to average (default: the run's "
                                "eval_batches for the validation split, all of a file).")
_DEVICES = flags.DEFINE_integer("devices", 1, "Devices to spread the batch over (data "
                                "parallel).")
_BYTES_PER_TOKEN = flags.DEFINE_float("bytes_per_token", None, "For bits per byte of a "
                                      "model whose tokens are not bytes.")
flags.mark_flags_as_required(["workdir"])


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    from jaxtrain import inference
    from jaxtrain.checkpoint import CheckpointError
    from jaxtrain.config import ConfigError
    from jaxtrain.data.sources import DataError

    try:
        step, cfg = inference.run_config(_WORKDIR.value)
        name, windows, byte_level = inference.evaluation_windows(cfg, _DATA.value)
        rows = cfg.train.global_batch
        batches = _BATCHES.value or (cfg.eval_batches if _DATA.value is None
                                     else len(windows) // rows)
        if batches < 1 or batches * rows > len(windows):
            raise DataError(f"{name} holds {len(windows)} windows of {cfg.model.seq_len + 1} "
                            f"tokens: fewer than {max(batches, 1)} batches of {rows}")
        loaded = inference.load(_WORKDIR.value, data=_DEVICES.value, batch=rows)
    except (ConfigError, CheckpointError, DataError) as e:
        sys.exit(f"jaxtrain: error: {e}")
    result = inference.evaluate(loaded, windows, batches)
    per_byte = 1.0 if byte_level else _BYTES_PER_TOKEN.value
    result["bits_per_byte"] = None if per_byte is None else result["bits_per_token"] / per_byte
    print(json.dumps({"workdir": str(_WORKDIR.value), "step": step, "data": name,
                      "quantized": loaded.quantization is not None, **result}))


if __name__ == "__main__":
    from jaxtrain.cli import parse_flags

    app.run(main, flags_parser=parse_flags)
