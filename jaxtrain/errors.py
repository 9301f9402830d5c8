"""The errors every command reports as one line and exit code 2 (usage, config, input).

They live at the bottom of the package so that any layer can raise them without importing
the layers above it; each message names the key or input and what would be valid.
"""

from __future__ import annotations

import importlib.util


class JaxtrainError(Exception):
    """Base of the one-line, exit-code-2 errors."""


class ConfigError(JaxtrainError, ValueError):
    """A config value that cannot work; the message is one line naming the key."""


class DataError(JaxtrainError, ValueError):
    """A data source that cannot be read; the message is one line naming the source."""


class CheckpointError(JaxtrainError, RuntimeError):
    """No usable checkpoint where one was expected, or one that does not fit the config."""


# "In use": the run directory is another run's (its lock, or a lease that was taken over).
# Not 2: a launcher retries it after the wait docs/operations.md gives (EX_TEMPFAIL).
IN_USE = 75


class WorkdirBusy(ConfigError):
    """The workdir is locked by another run (one line, exit code IN_USE, which the launchers
    retry after the lease's takeover time)."""
    exit_code = IN_USE


class LeaseLost(JaxtrainError, RuntimeError):
    """This run's lease was taken over, or its heartbeat failed for longer than the takeover
    time: it stops before its next write (one line, exit code IN_USE)."""
    exit_code = IN_USE


class StoreUnavailable(JaxtrainError, RuntimeError):
    """The store did not take what the run had to write (past the outbox's bound, or past
    the final wait): one line naming where it was kept instead, exit code IN_USE (75,
    EX_TEMPFAIL: the launchers try again later)."""
    exit_code = IN_USE


class LeaseUnconfirmed(TimeoutError):
    """The store has not answered this run's lease for longer than the takeover time: a
    write waits (a transient error, which the one retry policy tries again) until the lease
    is read back as this run's and renewed, or is found taken over (LeaseLost)."""


def fail(key: str, value, valid: str) -> None:
    """Raises ConfigError('KEY=VALUE is invalid: VALID')."""
    raise ConfigError(f"{key}={value!r} is invalid: {valid}")


# How to get each package an optional feature runs on: the pyproject extra that installs it,
# or the package itself for a dependency every install has (a pruned or broken environment).
INSTALL = {
    "wandb": "pip install 'jaxtrain[wandb]'",
    "lm_eval": "pip install 'jaxtrain[eval]'",
    **{name: "pip install 'jaxtrain[data]'"
       for name in ("pyarrow", "datasets", "sentencepiece", "tiktoken")},
    "tensorboardX": "pip install tensorboardX (a dependency of jaxtrain)",
    "transformers": "pip install transformers",
    **{name: "pip install 'jaxtrain[serve]'" for name in ("fastapi", "uvicorn")},
}


def missing_package(module: str) -> bool:
    """Whether top-level package `module` cannot be imported, found without importing it
    (wandb's import alone takes seconds). A directory that an uninstall left behind would
    import as an empty namespace package (no origin), so it counts as missing too."""
    try:
        spec = importlib.util.find_spec(module)
    except ValueError:  # imported already, without a spec: it is there
        return False
    return spec is None or spec.origin is None


def require_package(module: str, what: str, install: str | None = None,
                    error: type[JaxtrainError] = ConfigError) -> None:
    """Raises `error`: 'WHAT needs the MODULE package: pip install ...' (one line) when the
    package is missing; checked before anything is written, so that the run or prepare
    that needs it never starts."""
    if missing_package(module):
        raise error(f"{what} needs the {module} package: "
                    f"{install or INSTALL.get(module, f'pip install {module}')}")


def divisor_list(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def divisors(n: int) -> str:
    """'1, 2, 4, 8' for 8: the values a config error proposes."""
    return ", ".join(map(str, divisor_list(n)))
