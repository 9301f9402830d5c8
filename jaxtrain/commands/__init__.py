"""The `jaxtrain` command line: one subcommand per module of this package.

    jaxtrain train --config configs/NAME.py [--config.KEY=VALUE ...] [--workdir DIR]
    jaxtrain prepare | plan | generate | serve | eval | quantize | convert | report | launch

`python -m jaxtrain.main` is `jaxtrain train`, and `python -m jaxtrain.commands.NAME` runs
NAME. Importing this package imports neither jax nor the command modules: `train` must
re-execute itself (hostmem.py) and `plan --compile` set fake devices before jax loads.
"""

from __future__ import annotations

import importlib
import sys

from jaxtrain import hostmem  # imports nothing heavy

# subcommand -> (module in this package, one line of help)
COMMANDS = {
    "train": ("train", "train a model (the same as python -m jaxtrain.main)"),
    "prepare": ("prepare", "tokenize text, JSON Lines, Parquet or HF datasets into shards"),
    "plan": ("plan", "memory, step time, MFU and cost of a config on a hardware catalog entry"),
    "generate": ("generate", "continue prompts or chat with a trained model (the engine)"),
    "serve": ("serve", "an OpenAI-compatible HTTP server on a trained model"),
    "eval": ("eval", "loss, perplexity and bits per byte of a trained model"),
    "quantize": ("quantize", "int8 post-training quantization of a trained model"),
    "convert": ("convert", "import from / export to Hugging Face (every family: convert --help)"),
    "report": ("report", "draw a run's metrics into a PNG"),
    "launch": ("launch", "start a multi-process job on this machine"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "usage: jaxtrain COMMAND [ARGS...]  (jaxtrain COMMAND --help)\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """The console script `jaxtrain`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxtrain: error: no command {name!r}; valid: {', '.join(COMMANDS)}",
              file=sys.stderr)
        sys.exit(2)
    if name == "train":  # re-executes before the command's imports, not after (hostmem.py)
        hostmem.restart_with_huge_pages()
    module = importlib.import_module(f"jaxtrain.commands.{COMMANDS[name][0]}")
    # A command either exits itself or returns its exit code (prepare: 2 for bad input, 130
    # when interrupted); a scheduler reads that code, so it must reach the process.
    sys.exit(module.main(rest) or 0)
