r"""Hugging Face import and export (GPT2LMHeadModel, LlamaForCausalLM).

    python -m jaxtrain.convert --from-hf DIR --config configs/NAME.py --workdir OUT \
        [--config.KEY=VALUE ...]
    python -m jaxtrain.convert --to-hf OUT_DIR --workdir RUN [--max_shard_size 2GB] \
        [--dtype float32]

Import writes a step-0 checkpoint (fresh optimizer state) and config.json into OUT, the way
the training loop does, so `python -m jaxtrain.main` with the same config and overrides
resumes from it. Export writes config.json and safetensors that
`transformers.AutoModelForCausalLM.from_pretrained` loads with no custom code.
The work is in jaxtrain/hf/: load.py (import), save.py (export), one mapping module per
family (gpt2.py, llama.py); docs/interop.md has the name table.
"""

from __future__ import annotations

import sys

import jax

from jaxtrain.checkpoint import CheckpointError
from jaxtrain.config import ConfigError
from jaxtrain.hf.load import import_hf
from jaxtrain.hf.save import DTYPES, export_hf, restore_params

__all__ = ["export_hf", "import_hf", "restore_params"]


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _define_flags():
    from absl import flags
    from ml_collections import config_flags

    config = config_flags.DEFINE_config_file(
        "config", None, "With --from-hf: the config file (and --config.KEY=VALUE overrides) "
        "the imported run will train with.", lock_config=True)
    values = {
        "from": flags.DEFINE_string("from-hf", None, "Import this Hugging Face directory."),
        "to": flags.DEFINE_string("to-hf", None, "Export the run's newest checkpoint here."),
        "workdir": flags.DEFINE_string("workdir", None, "The jaxtrain run directory: "
                                       "written by --from-hf, read by --to-hf."),
        "max_shard_size": flags.DEFINE_string("max_shard_size", "2GB", "--to-hf: largest "
                                              "safetensors file before sharding."),
        "dtype": flags.DEFINE_enum("dtype", "float32", list(DTYPES), "--to-hf: the dtype "
                                   "the tensors are written in."),
    }
    return config, values


def main(argv) -> None:
    del argv
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    config, flag = _CONFIG, _FLAGS
    source, target, workdir = flag["from"].value, flag["to"].value, flag["workdir"].value
    if bool(source) == bool(target):
        sys.exit("jaxtrain: error: give one of --from-hf DIR (import) or --to-hf OUT_DIR "
                 "(export)")
    if not workdir:
        sys.exit("jaxtrain: error: --workdir is required: the run to write (--from-hf) or "
                 "to read (--to-hf)")
    try:
        if source:
            if config.value is None:
                raise ConfigError("--from-hf needs --config configs/NAME.py: the run the "
                                  "imported weights will train with")
            setup, _ = import_hf(config.value, source, workdir)
            count = sum(x.size for x in jax.tree.leaves(setup.abstract_state().params))
            _say(f"jaxtrain: imported {source} ({count:,} parameters) into {workdir} at "
                 f"step 0; fine-tune it with python -m jaxtrain.main, the same --config and "
                 f"overrides, and --workdir {workdir}")
        else:
            if config.value is not None:
                raise ConfigError("--config is for --from-hf only: --to-hf reads the run's "
                                  "own config from its checkpoint")
            export_hf(workdir, target, flag["max_shard_size"].value, flag["dtype"].value)
    except (ConfigError, CheckpointError) as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from absl import app

    from jaxtrain.cli import parse_flags

    _CONFIG, _FLAGS = _define_flags()
    app.run(main, flags_parser=parse_flags)
