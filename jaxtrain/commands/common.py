"""What every command shares: flag parsing whose errors are one line, and one mapping from
errors to exit codes.

Exit codes, the same in every command: 0 done; 2 usage, config or input errors (one line,
`jaxtrain: error: ...`, before anything compiles or is written); 3 a training run that
stopped itself (too many non-finite steps, a hung step); 1 anything else (a bug: the
traceback is printed).
"""

from __future__ import annotations

import functools
import pathlib
import sys
from collections.abc import Callable

from absl import app, flags

from jaxtrain.errors import ConfigError, JaxtrainError

USAGE_ERROR = 2


def fail(message: str) -> None:
    """Prints 'jaxtrain: error: MESSAGE' and exits with the usage/config/input code."""
    print(f"jaxtrain: error: {message}", file=sys.stderr, flush=True)
    sys.exit(USAGE_ERROR)


def _config_path(argv) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


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
        fail(f"--config={path}: no such file")  # ml_collections would defer this error
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(str(_unknown_key(argv) or e))
    except Exception as e:  # noqa: BLE001 - ml_collections raises many kinds for a bad file
        try:
            message = _unknown_key(argv)
        except Exception:  # noqa: BLE001 - the original error is the better report then
            message = None
        fail(message or f"{type(e).__name__}: {e}")
    return []


def guarded(fn: Callable) -> Callable:
    """fn with the package's one-line errors turned into exit code 2."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JaxtrainError as e:
            fail(str(e))
    return run


def run_absl(command: str, main: Callable, argv: list[str] | None) -> None:
    """Runs an absl command: argv are the arguments after the command's name (None: this
    process's own, for `python -m jaxtrain.commands.NAME`)."""
    args = sys.argv if argv is None else [f"jaxtrain {command}", *argv]
    app.run(guarded(main), argv=args, flags_parser=parse_flags)
