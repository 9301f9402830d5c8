r"""Hugging Face import and export (every family below).

    jaxtrain convert --from-hf DIR|ORG/NAME --workdir OUT [--config configs/NAME.py]
        [--config.KEY=VALUE ...] [--allow-unused]
    jaxtrain convert --to-hf OUT_DIR --workdir RUN [--max_shard_size 2GB] [--dtype float32]
        [--adapter]

Import writes a step-0 checkpoint (fresh optimizer state) and config.json into OUT, the way
the training loop does, so `jaxtrain train --workdir OUT` fine-tunes it; the model config
comes from the directory's config.json (a model key given by --config or an override must
agree with it, floats within a relative 1e-6; an MoE model runs dropless). ORG/NAME that is
no directory is read from the local Hugging Face cache, offline. The directory's tokenizer,
if it has one, becomes the run's (OUT/tokenizer), and training refuses data prepared with
another (without one, OUT/tokenizer records none); its generation_config.json becomes the
run's (exported back by --to-hf). What is read is checked before anything is written: a
damaged safetensors file, a non-finite tensor and tensors that map to no parameter
(unless --allow-unused) are refused in one line.
Export writes config.json and safetensors that
`transformers.AutoModelForCausalLM.from_pretrained` loads with no custom code, and the run's
tokenizer as tokenizer.json + tokenizer_config.json for `AutoTokenizer` (the same ids).
A LoRA run (model.lora) exports its base with the adapters folded in; with --adapter, the
adapters alone in PEFT's format (adapter_config.json, adapter_model.safetensors).
The work is in jaxtrain/hf/: load.py (import), save.py (export), model_config.py (the
config from config.json), one mapping module per family; docs/interop.md has the name
tables.
"""

from __future__ import annotations

import shutil
import sys

import jax
from absl import flags, logging
from ml_collections import config_flags

from jaxtrain import storage
from jaxtrain.commands.common import (
    BASE_CONFIG_FILE,
    OVERRIDES_HELP,
    absl_argv,
    override_keys,
    run_absl,
)
from jaxtrain.config import base_config
from jaxtrain.data import record, tokenizers
from jaxtrain.errors import ConfigError, require_package
from jaxtrain.hf import families_help, family_of, hub, model_config
from jaxtrain.hf.adapter import CONFIG_FILE as ADAPTER_CONFIG
from jaxtrain.hf.files import read_config
from jaxtrain.hf.load import import_hf
from jaxtrain.hf.save import DTYPES, export_hf
from jaxtrain.inference import run_config
from jaxtrain.workdir import check_new_folder


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _define_flags(argv: list[str]) -> dict:
    return {
        "config": config_flags.DEFINE_config_file(
            "config", BASE_CONFIG_FILE, "With --from-hf: the config file (and "
            "--config.KEY=VALUE overrides) the imported run will train with; model keys it "
            "leaves at their defaults come from config.json.", lock_config=True,
            sys_argv=argv),
        "argv": argv,
        "from": flags.DEFINE_string("from-hf", None, "Import this Hugging Face directory, or "
                                    "ORG/NAME from the local Hugging Face cache (offline)."),
        "allow_unused": flags.DEFINE_bool("allow-unused", False, "--from-hf: import a "
                                          "checkpoint whose tensors map to no parameter, "
                                          "without them (else refused, listed)."),
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
    source, target, workdir = flag["from"].value, flag["to"].value, flag["workdir"].value
    if bool(source) == bool(target):
        raise ConfigError("give one of --from-hf DIR (import) or --to-hf OUT_DIR (export)")
    if not workdir:
        raise ConfigError("--workdir is required: the run to write (--from-hf) or to read "
                          "(--to-hf)")
    if source:
        _import(flag, source, workdir)
    else:
        if flags.FLAGS["config"].present:
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


def hf_source(source: str):
    """The local directory --from-hf names: a path (a bucket's: copied to scratch), or an
    ORG/NAME that is none, from the Hugging Face cache (hf/hub.py)."""
    directory = storage.local_copy(source, "--from-hf", "hf")
    if not directory.exists() and hub.is_model_id(source):
        return hub.snapshot(source)
    return directory


def import_config(cfg, directory, given: set[str] | None):
    """The run's config: `cfg` with its model keys not `given` from config.json."""
    hf = read_config(directory)
    return model_config.resolve(cfg, hf, family_of(hf, f"{directory / 'config.json'}"),
                                given)


def _import(flag: dict, source: str, workdir) -> None:
    cfg = flag["config"].value
    if cfg.model.lora.rank:
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank} is invalid for "
                          "--from-hf: import the base with model.lora.rank=0, then train "
                          "with model.lora.base=THAT_WORKDIR")
    given = set()
    if flags.FLAGS["config"].present:
        given = model_config.given_keys(cfg.model, base_config().model)
    given |= {k for k in override_keys(flag["argv"]) if k.startswith("model.")}
    directory = hf_source(source)
    cfg = import_config(cfg, directory, given)
    setup, _ = import_hf(cfg, directory, workdir, allow_unused=flag["allow_unused"].value)
    count = sum(x.size for x in jax.tree.leaves(setup.abstract_state().params))
    _say(f"jaxtrain: imported {source} ({count:,} parameters) into {workdir} at step 0; "
         f"fine-tune it with jaxtrain train --workdir {workdir} (its config is recorded "
         "there; a --config then sets training keys)")


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
             paths=("from-hf", "to-hf", "workdir"),
             epilog=families_help() + "\n\nWith --from-hf:\n" + OVERRIDES_HELP)


if __name__ == "__main__":
    main()
