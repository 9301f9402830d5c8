r"""Hugging Face import and export (GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM).

    jaxtrain convert --from-hf DIR --config configs/NAME.py --workdir OUT \
        [--config.KEY=VALUE ...]
    jaxtrain convert --to-hf OUT_DIR --workdir RUN [--max_shard_size 2GB] [--dtype float32]
        [--adapter]

Import writes a step-0 checkpoint (fresh optimizer state) and config.json into OUT, the way
the training loop does, so `jaxtrain train` with the same config and overrides resumes
from it; the directory's tokenizer, if it has one, becomes the run's (OUT/tokenizer), and
training refuses data prepared with another (without one, OUT/tokenizer records none).
Export writes config.json and safetensors that
`transformers.AutoModelForCausalLM.from_pretrained` loads with no custom code, and the run's
tokenizer as tokenizer.json + tokenizer_config.json for `AutoTokenizer` (the same ids).
A LoRA run (model.lora) exports its base with the adapters folded in; with --adapter, the
adapters alone in PEFT's format (adapter_config.json, adapter_model.safetensors).
The work is in jaxtrain/hf/: load.py (import), save.py (export), one mapping module per
family (gpt2.py, llama.py, mixtral.py); docs/interop.md has the name tables.
"""

from __future__ import annotations

import shutil
import sys

import jax
from absl import flags, logging
from ml_collections import config_flags

from jaxtrain import storage
from jaxtrain.commands.common import OVERRIDES_HELP, absl_argv, run_absl
from jaxtrain.data import record, tokenizers
from jaxtrain.errors import ConfigError, require_package
from jaxtrain.hf.adapter import CONFIG_FILE as ADAPTER_CONFIG
from jaxtrain.hf.load import import_hf
from jaxtrain.hf.save import DTYPES, export_hf
from jaxtrain.inference import run_config
from jaxtrain.workdir import check_new_folder


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _define_flags(argv: list[str]) -> dict:
    return {
        "config": config_flags.DEFINE_config_file(
            "config", None, "With --from-hf: the config file (and --config.KEY=VALUE "
            "overrides) the imported run will train with.", lock_config=True, sys_argv=argv),
        "from": flags.DEFINE_string("from-hf", None, "Import this Hugging Face directory."),
        "to": flags.DEFINE_string("to-hf", None, "Export the run's newest checkpoint here."),
        "workdir": flags.DEFINE_string("workdir", None, "The jaxtrain run directory: "
                                       "written by --from-hf, read by --to-hf."),
        "max_shard_size": flags.DEFINE_string("max_shard_size", "2GB", "--to-hf: largest "
                                              "safetensors file before sharding."),
        "adapter": flags.DEFINE_bool("adapter", False, "--to-hf of a LoRA run: the adapter "
                                     "alone in PEFT's format (adapter_config.json, "
                                     "adapter_model.safetensors), not the merged weights."),
        "dtype": flags.DEFINE_enum("dtype", "float32", list(DTYPES), "--to-hf: the dtype "
                                   "the tensors are written in."),
    }


def _convert(flag: dict, argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    config = flag["config"]
    source, target, workdir = flag["from"].value, flag["to"].value, flag["workdir"].value
    if bool(source) == bool(target):
        raise ConfigError("give one of --from-hf DIR (import) or --to-hf OUT_DIR (export)")
    if not workdir:
        raise ConfigError("--workdir is required: the run to write (--from-hf) or to read "
                          "(--to-hf)")
    if source:
        if config.value is None:
            raise ConfigError("--from-hf needs --config configs/NAME.py: the run the "
                              "imported weights will train with")
        if config.value.model.lora.rank:
            raise ConfigError(f"model.lora.rank={config.value.model.lora.rank} is invalid for "
                              "--from-hf: import the base with model.lora.rank=0, then train "
                              "with model.lora.base=THAT_WORKDIR")
        setup, _ = import_hf(config.value, storage.local_copy(source, "--from-hf", "hf"),
                             workdir)
        count = sum(x.size for x in jax.tree.leaves(setup.abstract_state().params))
        _say(f"jaxtrain: imported {source} ({count:,} parameters) into {workdir} at step 0; "
             f"fine-tune it with jaxtrain train, the same --config and overrides, and "
             f"--workdir {workdir}")
    else:
        if config.value is not None:
            raise ConfigError("--config is for --from-hf only: --to-hf reads the run's own "
                              "config from its checkpoint")
        # The destination first (a bucket that is missing or refuses writes, a folder that
        # holds files), then the tokenizer (a package it needs that is missing): before any
        # export is done.
        check_new_folder(storage.as_path(target, "--to-hf"), "--to-hf")
        tokenizer = record.run_tokenizer(workdir, run_config(workdir)[1])
        converter = tokenizer and tokenizers.KINDS[tokenizer.kind].export_package
        if converter:
            require_package(converter, f"exporting the run's {tokenizer.kind} tokenizer")
        _export(flag, workdir, target, tokenizer)


def _export(flag: dict, workdir, target, tokenizer) -> None:
    """Exports into a local staging directory (safetensors are written by a library that
    wants files), then commits it to `target` (storage.commit_files: a rename on disk; on a
    bucket an upload with config.json, what transformers looks for first, last)."""
    adapter = flag["adapter"].value
    destination = storage.as_path(target, "--to-hf")  # checked new or empty by _convert
    staged = storage.staging_dir(destination, "export")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    export_hf(workdir, staged, flag["max_shard_size"].value, flag["dtype"].value,
              adapter=adapter)
    if tokenizer is not None and not adapter:
        tokenizer.save_hf(staged)
        _say(f"jaxtrain: wrote the run's tokenizer ({tokenizer.describe()}) to {target}")
    count = len(storage.listing(staged))
    storage.commit_files(staged, destination, ADAPTER_CONFIG if adapter else "config.json")
    _say(f"jaxtrain: wrote {count} files to {target}")


def main(argv: list[str] | None = None) -> None:
    values = _define_flags(absl_argv("convert", argv))
    run_absl("convert", lambda args: _convert(values, args), argv,
             paths=("from-hf", "to-hf", "workdir"), epilog="With --from-hf:\n" + OVERRIDES_HELP)


if __name__ == "__main__":
    main()
