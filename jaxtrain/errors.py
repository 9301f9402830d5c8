"""The errors every command reports as one line and exit code 2 (usage, config, input).

They live at the bottom of the package so that any layer can raise them without importing
the layers above it; each message names the key or input and what would be valid.
"""

from __future__ import annotations


class JaxtrainError(Exception):
    """Base of the one-line, exit-code-2 errors."""


class ConfigError(JaxtrainError, ValueError):
    """A config value that cannot work; the message is one line naming the key."""


class DataError(JaxtrainError, ValueError):
    """A data source that cannot be read; the message is one line naming the source."""


class CheckpointError(JaxtrainError, RuntimeError):
    """No usable checkpoint where one was expected, or one that does not fit the config."""


def fail(key: str, value, valid: str) -> None:
    """Raises ConfigError('KEY=VALUE is invalid: VALID')."""
    raise ConfigError(f"{key}={value!r} is invalid: {valid}")


def divisor_list(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def divisors(n: int) -> str:
    """'1, 2, 4, 8' for 8: the values a config error proposes."""
    return ", ".join(map(str, divisor_list(n)))
