"""What every command shares: flag parsing whose errors are one line, and one mapping from
errors to exit codes.

Exit codes, the same in every command: 0 done; 2 usage, config or input errors (one line,
`jaxtrain: error: ...`, before anything compiles or is written); 3 a training run that
stopped itself (too many non-finite steps, a hung step); 1 anything else (a bug: the
traceback is printed).

`--help` prints the command's usage and its own flags (absl's --help would print only a
stub pointing at --helpfull, which lists every library's flags too).
"""

from __future__ import annotations

import functools
import pathlib
import sys
from collections.abc import Callable

from absl import app, flags

from jaxtrain import storage
from jaxtrain.errors import ConfigError, JaxtrainError
from jaxtrain.workdir import check_local_path

USAGE_ERROR = 2
HELP_FLAGS = ("-h", "-?", "--help", "-help", "--helpshort")

# The --config.KEY=VALUE overrides most runs use, for the --help of the commands that take a
# config file; jaxtrain/config.py base_config() has every key, with what it means.
OVERRIDES_HELP = """\
--config.KEY=VALUE overrides any key of the config file (jaxtrain/config.py lists them all,
with what each means); a wrong key or type is refused in one line. The common ones:
  --config.steps=N                       training steps
  --config.train.global_batch=B          sequences per step (all devices together)
  --config.train.microbatches=M          gradient accumulation: B/M sequences at a time
  --config.train.precision=P             float32, bfloat16, float16, fp8, ...
  --config.optimizer.lr=LR               peak learning rate (.warmup_steps, .schedule, ...)
  --config.model.d_model=D               also .num_layers, .num_heads, .mlp_dim, .seq_len,
                                         .vocab_size, .family, .attention, .remat
  --config.mesh.data=N                   also .fsdp, .tensor, .pipeline, .context, .expert
                                         (-1: the rest of the devices)
  --config.data.source=S                 stdlib, bin, synthetic or prepared; with
                                         --config.data.path=DIR (or .mixture=DIR:W,...)
  --config.log_every_steps=N             also .eval_every_steps, .eval_batches
  --config.checkpoint.every_steps=N      also .keep, .local_dir
  --config.metrics.sinks=jsonl,tensorboard[,wandb]
  --config.eval.tasks=hellaswag,...      downstream tasks during training"""


# --config's default where a command may go without one (commands/base_config_file.py).
BASE_CONFIG_FILE = str(pathlib.Path(__file__).with_name("base_config_file.py"))


def override_keys(argv) -> set[str]:
    """The keys argv's --config.KEY=VALUE overrides set: {'model.seq_len', 'steps'}."""
    return {arg[len("--config."):].split("=", 1)[0] for arg in argv
            if arg.startswith("--config.")}


def exit_usage(message: str, code: int = USAGE_ERROR) -> None:
    """Prints 'jaxtrain: error: MESSAGE' and exits with the usage/config/input code (or
    `code`: errors.IN_USE for a workdir another run holds)."""
    print(f"jaxtrain: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def flag_value(argv, name: str) -> str | None:
    """The value of --NAME in argv (--NAME=V or --NAME V), before the flags are parsed."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _config_path(argv) -> str | None:
    return flag_value(argv, "config")


def _unknown_key(argv) -> str | None:
    """A one-line message for the first --config.KEY override that names no key, or for a
    config file that cannot be loaded."""
    path = _config_path(argv)
    if path is None:
        return None
    from jaxtrain.config import load_config_file  # jax and the models, only on this error

    try:
        cfg = load_config_file(path.split(":")[0])
    except ConfigError as e:
        return str(e)
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config."):].split("=", 1)[0]
        node, walked = cfg, []
        for part in key.split("."):
            if not hasattr(node, "keys") or part not in node:
                where = ".".join(walked) or "the top level"
                valid = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "none"
                return f"--config.{key}: there is no key {part!r} under {where}; valid: {valid}"
            node, walked = node[part], walked + [part]
    return None


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flags_parser for app.run: bad flags, a missing or broken --config file and
    unknown --config.KEY overrides become one line and exit code 2, not a traceback."""
    path = _config_path(argv)
    if path is not None and not pathlib.Path(path.split(":")[0]).is_file():
        exit_usage(f"--config={path}: no such file")  # ml_collections would defer this error
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        exit_usage(str(_unknown_key(argv) or e))
    except Exception as e:  # noqa: BLE001 - ml_collections raises many kinds for a bad file
        try:
            message = _unknown_key(argv)
        except Exception:  # noqa: BLE001 - the original error is the better report then
            message = None
        exit_usage(message or f"{type(e).__name__}: {e}")
    return []


def guarded(fn: Callable) -> Callable:
    """fn with the package's one-line errors turned into exit code 2."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JaxtrainError as e:
            exit_usage(str(e), getattr(e, "exit_code", USAGE_ERROR))
    return run


def command_help(module: str, epilog: str = "") -> str:
    """The usage of the command in `module` (its docstring) and the flags it defines, with
    their help and defaults."""
    doc = (sys.modules[module].__doc__ or "").strip()
    own = flags.FLAGS.module_help(module).strip().splitlines()[1:]  # less 'MODULE:'
    return "\n\n".join(part for part in (doc, "flags:\n" + "\n".join(own), epilog) if part)


# The path flags that may name object storage (gs://, s3://) in every command; the others
# are local only, for now (workdir.check_local_path says so in one line). --out: eval's
# results file and quantize's model directory, written through storage.py.
REMOTE_FLAGS = ("workdir", "from-hf", "to-hf", "out")


def check_paths(names: tuple[str, ...]) -> None:
    """storage.check_path (REMOTE_FLAGS) or check_local_path for the parsed flags `names`
    (list flags: each item)."""
    for name in names:
        value = flags.FLAGS[name].value
        check = storage.check_path if name in REMOTE_FLAGS else check_local_path
        for item in value if isinstance(value, list) else [value]:
            if item:
                check(item, f"--{name}")


def absl_argv(command: str, argv: list[str] | None) -> list[str]:
    """The full argv absl parses: argv are the arguments after the command's name (None:
    this process's own, for `python -m jaxtrain.commands.NAME`). A --config flag needs it
    when defined (ml_collections finds the --config.KEY overrides in it), else it reads
    sys.argv, which differs when a command runs in-process."""
    return sys.argv if argv is None else [f"jaxtrain {command}", *argv]


def run_absl(command: str, main: Callable, argv: list[str] | None,
             paths: tuple[str, ...] = (), epilog: str = "") -> None:
    """Runs an absl command (argv: as for absl_argv); `paths` are its flags that name
    files or directories, checked before main runs; `epilog` ends its --help."""
    args = absl_argv(command, argv)
    if any(arg in HELP_FLAGS for arg in args[1:]):
        # The flags are registered under the module that defined them: the command's, or
        # __main__ for `python -m jaxtrain.commands.NAME`; main is defined there too.
        print(command_help(main.__module__, epilog))
        sys.exit(0)

    def checked(rest):
        check_paths(paths)
        return main(rest)

    app.run(guarded(checked), argv=args, flags_parser=parse_flags)
