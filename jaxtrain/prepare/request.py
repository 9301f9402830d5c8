"""What a prepare is asked to do (the command's options), in six small records: where the
documents come from (Inputs), how they are read (records.Options), which tokenizer
(TokenizerChoice), whether the records are chats (Chat), what is written (Output) and how
the work runs (Run)."""

from __future__ import annotations

import dataclasses

from jaxtrain.errors import DataError
from jaxtrain.prepare.chat import TRAIN_ON
from jaxtrain.prepare.records import TEXT_UNITS, Options

POLICIES = ("auto", "yes", "no")


@dataclasses.dataclass
class Inputs:
    """Files, directories and globs, or a Hugging Face dataset (a name to stream, or a
    directory saved with save_to_disk)."""

    paths: list[str] = dataclasses.field(default_factory=list)
    hf_dataset: str | None = None
    hf_config: str | None = None
    format: str = "auto"
    include_hidden: bool = False  # files and directories whose name starts with "."
    include_binary: bool = False  # text files that readers.is_binary


@dataclasses.dataclass
class TokenizerChoice:
    spec: str | None = None  # --tokenizer
    train: int | None = None  # --train-tokenizer VOCAB
    only: bool = False  # --tokenizer-only: write the trained tokenizer, no dataset


@dataclasses.dataclass
class Chat:
    """--chat: records are conversations (jaxtrain.prepare.chat), rendered with a chat
    template and given a loss mask."""

    enabled: bool = False  # --chat
    template: str | None = None  # --chat-template FILE or a shipped name
    train_on: str = "assistant"  # TRAIN_ON
    max_length: int | None = None  # tokens; longer conversations are skipped and counted
    # --preference: records are preference pairs (jaxtrain.prepare.preference), each stored
    # as two adjacent documents; implies enabled
    preference: bool = False


@dataclasses.dataclass
class Output:
    path: str = ""
    bos: str = "auto"  # POLICIES
    eos: str = "auto"
    tokens_per_file: int = 1 << 27
    unit_bytes: int = 1 << 20  # input bytes per unit of work: decides the shard bounds
    overwrite: bool = False


@dataclasses.dataclass
class Run:
    processes: int = 0  # 0: one per CPU
    shard: tuple[int, int] | None = None  # part i of n of a multi-machine prepare
    max_bad_fraction: float = 0.01
    progress: bool = True


# The record each flat option (a command flag's name) belongs to, for `Request.build`.
_GROUPS = {"inputs": Inputs, "reading": Options, "tokenizer": TokenizerChoice,
           "chat": Chat, "output": Output, "run": Run}
_RENAMED = {"inputs": ("inputs", "paths"), "out": ("output", "path"),
            "tokenizer": ("tokenizer", "spec"), "train_tokenizer": ("tokenizer", "train"),
            "tokenizer_only": ("tokenizer", "only"), "chat": ("chat", "enabled"),
            "chat_template": ("chat", "template")}


@dataclasses.dataclass
class Request:
    """One prepare."""

    inputs: Inputs
    reading: Options
    tokenizer: TokenizerChoice
    output: Output
    run: Run
    chat: Chat = dataclasses.field(default_factory=Chat)

    @classmethod
    def build(cls, inputs, out, **options) -> Request:
        """A request from flat options named as the command's flags (`field=`, `shard=`,
        `train_tokenizer=`), each put in its record: for callers that hold them flat (the
        command, tests, scripts)."""
        parts: dict[str, dict] = {name: {} for name in _GROUPS}
        for key, value in {"inputs": [str(i) for i in inputs or []], "out": str(out),
                           **options}.items():
            group, field = _RENAMED.get(key, (None, key))
            if group is None:
                group = next((g for g, record in _GROUPS.items()
                              if field in {f.name for f in dataclasses.fields(record)}), None)
            if group is None or (group == "reading" and field == "chat"):
                raise TypeError(f"Request.build: no option {key!r}")
            parts[group][field] = value
        return cls(**{name: record(**parts[name]) for name, record in _GROUPS.items()})


def check(r: Request) -> None:
    """DataError (one line) for options that cannot go together or are out of range."""
    for key, value in (("--bos", r.output.bos), ("--eos", r.output.eos)):
        if value not in POLICIES:
            raise DataError(f"{key}={value} is invalid: valid values are {', '.join(POLICIES)}")
    if r.reading.text_unit not in TEXT_UNITS:
        raise DataError(f"--text-unit={r.reading.text_unit} is invalid: valid values are "
                        f"{', '.join(TEXT_UNITS)}")
    if (r.tokenizer.spec is None) == (r.tokenizer.train is None):
        raise DataError("give one of --tokenizer SPEC and --train-tokenizer VOCAB")
    if r.tokenizer.only and r.tokenizer.train is None:
        raise DataError("--tokenizer-only goes with --train-tokenizer VOCAB")
    if r.tokenizer.train is not None and r.run.shard is not None:
        raise DataError("--train-tokenizer with --shard would train a different tokenizer on "
                        "each part: train one first (--train-tokenizer V --tokenizer-only) and "
                        "pass it to every part with --tokenizer")
    if not 0.0 <= r.run.max_bad_fraction <= 1.0:
        raise DataError(f"--max-bad-fraction={r.run.max_bad_fraction} is invalid: between 0 "
                        "and 1")
    if r.output.tokens_per_file < 1 or r.output.unit_bytes < 1:
        raise DataError("--tokens-per-file and --unit-bytes must be >= 1")
    if bool(r.inputs.paths) == bool(r.inputs.hf_dataset):
        raise DataError("give input files, or --hf-dataset NAME, not both or neither")
    if r.run.shard is not None:
        i, n = r.run.shard
        if not 0 <= i < n:
            raise DataError(f"--shard={i}/{n} is invalid: i/N with 0 <= i < N")
    _check_chat(r)


def _check_chat(r: Request) -> None:
    chat = r.chat
    if chat.preference and not chat.enabled:
        raise DataError("--preference renders its records with the chat template: it goes "
                        "with the chat options (Chat.enabled)")
    if chat.preference and chat.train_on != "assistant":
        raise DataError(f"--train-on={chat.train_on} with --preference: DPO compares the "
                        "replies' log-likelihoods, so the mask is on the replies; leave "
                        "--train-on assistant")
    if not chat.enabled:
        for key, value, default in (("--chat-template", chat.template, None),
                                    ("--train-on", chat.train_on, "assistant"),
                                    ("--max-length", chat.max_length, None)):
            if value != default:
                raise DataError(f"{key} goes with --chat (records that are conversations)")
        return
    if chat.train_on not in TRAIN_ON:
        raise DataError(f"--train-on={chat.train_on} is invalid: valid values are "
                        f"{', '.join(TRAIN_ON)}")
    if chat.max_length is not None and chat.max_length < 2:
        raise DataError(f"--max-length={chat.max_length} is invalid: at least 2 tokens")
    if r.tokenizer.train is not None:
        raise DataError("--chat with --train-tokenizer: train one first (--train-tokenizer V "
                        "--tokenizer-only) and pass it with --tokenizer")
    for key, value in (("--bos", r.output.bos), ("--eos", r.output.eos)):
        if value == "yes":
            raise DataError(f"{key}=yes with --chat: the chat template writes the special "
                            "tokens; leave it auto (no extra BOS/EOS)")
