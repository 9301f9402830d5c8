"""jaxtrain prepare: text, JSON Lines, Parquet or Hugging Face datasets -> token shards.

    jaxtrain prepare INPUT... --out DIR (--tokenizer SPEC | --train-tokenizer VOCAB) [options]
    jaxtrain prepare --stdlib --out DIR ...        (the built-in corpus, one file a document)
    jaxtrain prepare --hf-dataset NAME --out DIR ...
    jaxtrain prepare INPUT... --out DIR --shard I/N ...   then   jaxtrain prepare --merge DIR
    jaxtrain prepare INPUT... --out DIR --ray [ADDRESS] [--parts N]   (the parts on Ray)
    jaxtrain prepare CHATS.jsonl --chat --out DIR --tokenizer T [--chat-template chatml]
    jaxtrain prepare PAIRS.jsonl --preference --out DIR --tokenizer T --max-length N  (DPO)
    jaxtrain prepare PROMPTS.jsonl --prompts --out DIR --tokenizer T  (RL prompt sets)

INPUTs, --out DIR and --merge DIR may be gs:// or s3:// URLs: inputs are downloaded to a local
cache first, and the dataset is prepared on local disk, then uploaded with its manifest last.

INPUTs are files, directories (every file below but hidden ones) or globs (quote them; `**`
recurses); binary files are left out (--include-hidden, --include-binary take them). The
format comes from the name (.jsonl/.ndjson/.json[.gz]: JSON Lines, .parquet: Parquet, a
`save_to_disk` directory: a Hugging Face dataset, anything else: text) or --format. Also
`python -m jaxtrain.commands.prepare`. docs/data.md has the details.
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain import storage
from jaxtrain.data.stdlib import stdlib_files
from jaxtrain.errors import DataError, JaxtrainError
from jaxtrain.prepare import chat_template, on_ray
from jaxtrain.prepare import merge as merge_lib
from jaxtrain.prepare import pipeline as prepare_lib
from jaxtrain.prepare import prompts as prompts_lib
from jaxtrain.prepare.formats import FORMATS
from jaxtrain.prepare.records import Options
from jaxtrain.prepare.request import Chat, Inputs, Output, Run, TokenizerChoice


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard={text}: expected I/N, e.g. 3/16") from None
    return i, n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxtrain prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", help="files, directories or globs")
    p.add_argument("--out", help="the dataset directory to write")
    for add_group in (_tokenizer_flags, _input_flags, _chat_flags, _output_flags, _run_flags):
        add_group(p)
    return p


def _tokenizer_flags(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("tokenizer (one of)")
    what.add_argument("--tokenizer", help="bytes, tiktoken:NAME, a tokenizer.json, a "
                      "SentencePiece .model, or a (model or tokenizer) directory")
    what.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                      help="train a byte-level BPE of VOCAB ids on the inputs")
    what.add_argument("--tokenizer-only", action="store_true",
                      help="with --train-tokenizer: write only the tokenizer, to --out")


def _input_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("inputs")
    src.add_argument("--stdlib", action="store_true", help="add the built-in corpus's files "
                     "(this Python's standard library .py files)")
    src.add_argument("--format", default="auto", help=", ".join(("auto", *FORMATS)))
    src.add_argument("--include-hidden", action="store_true", help="also take the files of "
                     "an input directory whose path below it has a name starting with '.' "
                     "(.git/, .env), and let globs match such names")
    src.add_argument("--include-binary", action="store_true", help="also take text-format "
                     "files whose first 8 KiB hold a NUL byte or are mostly not UTF-8")
    src.add_argument("--field", default="text", help="the text field of JSON/Parquet/datasets")
    src.add_argument("--text-unit", default="file", help="text files: one document per file "
                     "(file) or per line (line)")
    src.add_argument("--hf-dataset", help="a Hugging Face dataset name or local path, "
                     "streamed with datasets.load_dataset (hub names need network)")
    src.add_argument("--hf-config", help="the dataset's configuration name")
    src.add_argument("--split", default="train", help="the split of --hf-dataset or of a "
                     "saved DatasetDict")


def _chat_flags(p: argparse.ArgumentParser) -> None:
    chat = p.add_argument_group("chat and instruction records")
    chat.add_argument("--chat", action="store_true", help="records are conversations: "
                      "`messages` [{role, content}] or `prompt` + `completion`, rendered with "
                      "the chat template, with a loss mask (docs/data.md)")
    chat.add_argument("--preference", action="store_true", help="records are preference "
                      "pairs for DPO: `prompt` (or `messages`) with `chosen` and `rejected` "
                      "replies, each pair stored as two documents masked on the replies "
                      "(docs/finetune.md); the chat options apply")
    chat.add_argument("--prompts", action="store_true", help="records are prompts for RL: "
                      "`prompt` (text or messages) or `messages`, other columns kept for the "
                      "reward functions; rendered with the chat template's generation prompt "
                      "into OUT/prompts.jsonl (docs/finetune.md); --max-length skips longer "
                      "ones")
    chat.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file, or "
                      f"a shipped one ({', '.join(chat_template.shipped_names())}); default: "
                      "the tokenizer's own")
    chat.add_argument("--train-on", default="assistant", help="the tokens the loss counts: "
                      "assistant (the assistant turns) or all")
    chat.add_argument("--max-length", type=int, metavar="N", help="skip (and count) "
                      "conversations of more than N tokens (give seq_len + 1: a longer one "
                      "would be cut into pieces without their prompt)")


def _output_flags(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--bos", default="auto", help="auto, yes, no: BOS before each document "
                     "(auto: when the tokenizer has one distinct from its EOS)")
    out.add_argument("--eos", default="auto", help="auto, yes, no: EOS after each document "
                     "(auto: when the tokenizer has one)")
    out.add_argument("--tokens-per-file", type=int, default=1 << 27,
                     help="close a shard after this many tokens (at a unit boundary)")
    out.add_argument("--unit-bytes", type=int, default=1 << 20,
                     help="input bytes per unit of work (changing it changes shard bounds)")
    out.add_argument("--max-bad-fraction", type=float, default=0.01,
                     help="abort when more than this fraction of records are unusable")
    out.add_argument("--overwrite", action="store_true",
                     help="prepare again even if --out already holds this dataset, and "
                     "replace one prepared from other inputs or options")


def _run_flags(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("running")
    run.add_argument("--processes", type=int, default=0, help="worker processes (0: one per "
                     "CPU)")
    run.add_argument("--shard", type=_shard, metavar="I/N", help="prepare only part I of N "
                     "of the inputs (the records starting in the I-th of N equal byte ranges), "
                     "into OUT/part-I-of-N (then --merge OUT)")
    run.add_argument("--merge", metavar="DIR", help="merge the finished parts in DIR")
    run.add_argument("--ray", nargs="?", const="", metavar="ADDRESS", help="run the parts as "
                     "Ray tasks on the cluster at ADDRESS (none: RAY_ADDRESS, or a local one), "
                     "then merge them into OUT (the [ray] extra)")
    run.add_argument("--parts", type=int, metavar="N", help="with --ray: the number of parts "
                     "(default: the parts OUT already holds, else one per CPU of the cluster)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        # Every path may be on object storage: inputs, --out and --merge (jaxtrain.prepare.
        # remote), a --tokenizer file or directory (copied to scratch to be read).
        for key, values in (("input", args.inputs), ("--out", [args.out]),
                            ("--merge", [args.merge]), ("--tokenizer", [args.tokenizer])):
            for value in values:
                storage.check_path(value or "", key)
        if args.merge:
            merge_lib.merge(args.merge)
            return 0
        if not args.out:
            raise DataError("--out DIR is required: the dataset directory to write")
        if args.prompts:
            return _prompts(args)
        inputs = list(args.inputs) + ([str(p) for p in stdlib_files()] if args.stdlib else [])
        request = prepare_lib.Request(
            inputs=Inputs(paths=inputs, hf_dataset=args.hf_dataset, hf_config=args.hf_config,
                          format=args.format, include_hidden=args.include_hidden,
                          include_binary=args.include_binary),
            reading=Options(field=args.field, text_unit=args.text_unit, split=args.split),
            tokenizer=TokenizerChoice(spec=args.tokenizer, train=args.train_tokenizer,
                                      only=args.tokenizer_only),
            output=Output(path=args.out, bos=args.bos, eos=args.eos,
                          tokens_per_file=args.tokens_per_file, unit_bytes=args.unit_bytes,
                          overwrite=args.overwrite),
            run=Run(processes=args.processes, shard=args.shard,
                    max_bad_fraction=args.max_bad_fraction, progress=not args.no_progress),
            chat=Chat(enabled=args.chat or args.preference, template=args.chat_template,
                      train_on=args.train_on, max_length=args.max_length,
                      preference=args.preference))
        if args.ray is not None:
            on_ray.prepare_on_ray(request, args.ray or None, args.parts)
        elif args.parts is not None:
            raise DataError("--parts goes with --ray")
        else:
            prepare_lib.prepare(request)
    except JaxtrainError as e:  # DataError, and ConfigError (paths, object-store access)
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxtrain: interrupted; run the same command again to continue", file=sys.stderr)
        return 130
    return 0


def _prompts(args) -> int:
    """prepare --prompts: the prompt set (prepare/prompts.py), which the token pipeline's
    options do not apply to."""
    others = [flag for flag, on in (
        ("--chat", args.chat), ("--preference", args.preference), ("--shard", args.shard),
        ("--ray", args.ray is not None), ("--hf-dataset", args.hf_dataset),
        ("--stdlib", args.stdlib), ("--train-tokenizer", args.train_tokenizer)) if on]
    if others:
        raise DataError(f"--prompts does not go with {', '.join(others)}")
    if not args.tokenizer:
        raise DataError("--prompts needs --tokenizer (the model's: its chat template renders "
                        "the prompts)")
    manifest = prompts_lib.prepare_prompts(
        args.inputs, args.out, args.tokenizer, args.chat_template, args.max_length,
        args.overwrite, args.max_bad_fraction)
    print(f"jaxtrain: {manifest['prompts']:,} prompts -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
