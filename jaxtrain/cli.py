"""Flag parsing shared by the command-line tools: config errors as one line, not a traceback."""

from __future__ import annotations

import sys

from absl import flags


def _config_path(argv) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _unknown_key(argv) -> str | None:
    """A one-line message for the first --config.KEY override that names no key."""
    path = _config_path(argv)
    if path is None:
        return None
    from jaxtrain.config import load_config_file

    cfg = load_config_file(path.split(":")[0])
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
    """absl's flags_parser for app.run, turning bad config overrides into one-line errors."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"jaxtrain: error: {e}")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        try:
            message = _unknown_key(argv)
        except Exception:  # noqa: BLE001 - the original error is the better report then
            message = None
        sys.exit(f"jaxtrain: error: {message or e}")
