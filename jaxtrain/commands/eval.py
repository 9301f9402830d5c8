"""jaxtrain eval --workdir RUN [--data FILE] [--batches N] [--devices N]

Loss, perplexity and bits per token/byte of a run's newest checkpoint (or a quantized model
directory) as one JSON line: on the run's validation split by default, or on a token file
(`.bin`, in the run's data.dtype) or a text file (any other name; encoded with the run's
tokenizer). Bits per byte come from real byte counts: the UTF-8 bytes each evaluated target
token stands for, by the run's tokenizer (WORKDIR/tokenizer); for a run without one, pass
--bytes_per_token (the tokenizer's average on that text) to get them.
"""

from __future__ import annotations

import json

from absl import flags, logging

from jaxtrain import inference
from jaxtrain.commands.common import run_absl
from jaxtrain.data import record
from jaxtrain.data.packing import Packed, counted_targets
from jaxtrain.errors import DataError


def _define_flags() -> dict:
    values = {
        "workdir": flags.DEFINE_string("workdir", None, "A run directory, or a quantized "
                                       "model's."),
        "data": flags.DEFINE_string("data", None, "A token file (.bin) or text file; "
                                    "default: the run's validation split."),
        "batches": flags.DEFINE_integer("batches", None, "Batches to average (default: the "
                                        "run's eval_batches for the validation split, all of "
                                        "a file)."),
        "devices": flags.DEFINE_integer("devices", 1, "Devices to spread the batch over "
                                        "(data parallel)."),
        "bytes_per_token": flags.DEFINE_float("bytes_per_token", None, "For bits per byte of "
                                              "a model whose tokens are not bytes."),
    }
    flags.mark_flags_as_required(["workdir"])
    return values


def target_bytes(tokenizer, windows, count: int) -> int:
    """UTF-8 bytes of the text the target tokens of the first `count` windows stand for
    (packed rows: their counted targets)."""
    table = tokenizer.token_bytes()
    total = 0
    for i in range(count):
        row = windows[i]
        if isinstance(row, Packed):
            total += int(table[row.tokens[1:][counted_targets(row.segments)]].sum())
        else:
            total += int(table[row[1:]].sum())
    return total


def _evaluate(f: dict, argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    workdir, data = f["workdir"].value, f["data"].value
    step, cfg = inference.run_config(workdir)
    tokenizer = record.run_tokenizer(workdir, cfg)
    name, windows, byte_level = inference.evaluation_windows(cfg, data, tokenizer)
    rows = cfg.train.global_batch
    batches = f["batches"].value or (cfg.eval_batches if data is None else len(windows) // rows)
    if batches < 1 or batches * rows > len(windows):
        raise DataError(f"{name} holds {len(windows)} windows of {cfg.model.seq_len + 1} "
                        f"tokens: fewer than {max(batches, 1)} batches of {rows}")
    loaded = inference.load(workdir, data=f["devices"].value, batch=rows)
    result = inference.evaluate(loaded, windows, batches)
    if tokenizer is not None:
        result["bytes"] = target_bytes(tokenizer, windows, batches * rows)
        result["bits_per_byte"] = result["bits_per_token"] * result["tokens"] / result["bytes"]
    else:
        per_byte = 1.0 if byte_level else f["bytes_per_token"].value
        result["bits_per_byte"] = (None if per_byte is None
                                   else result["bits_per_token"] / per_byte)
    print(json.dumps({"workdir": str(workdir), "step": step, "data": name,
                      "quantized": loaded.quantization is not None, **result}))


def main(argv: list[str] | None = None) -> None:
    values = _define_flags()
    run_absl("eval", lambda args: _evaluate(values, args), argv)


if __name__ == "__main__":
    main()
