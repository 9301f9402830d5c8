"""The one retry policy of every remote transfer: which errors are worth trying again, how
long to keep trying, and saying so while a store does not answer.

A failure is transient (`transient`) when trying again may fix it: a lost, refused or reset
connection, a timeout, a server error (HTTP 5xx, 408, 429), or any error the client
libraries raise that is none of the permanent kinds. It is permanent when trying again
cannot fix it: a missing object, a refusal (credentials, permission: `storage.user_error`
turns those into one line), a bad request (HTTP 4xx, a bad range, a wrong argument).

`call` runs an attempt until it succeeds, sleeping 1, 2, 4, ... 30 s between attempts, for
up to the budget ($JAXTRAIN_STORAGE_RETRY_S, 120 s by default), then raises `Unreachable`,
whose message is one line naming what failed and the last error. While one attempt hangs
(a store that accepts connections and does not answer: a paused server, a black-holed
route), `watch` says so every $JAXTRAIN_STORAGE_STALL_S seconds (30 by default), naming the
store and how long it has waited, so a stall is seen as it happens.

Every caller runs on a background thread (metrics segments, the lease's heartbeat,
checkpoint uploads), so a transfer that waits out its budget never holds the training step.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import threading
import time

from jaxtrain.errors import ConfigError

RETRY_ENV = "JAXTRAIN_STORAGE_RETRY_S"
STALL_ENV = "JAXTRAIN_STORAGE_STALL_S"
BUDGET_S = 120.0
STALL_S = 30.0
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
# Errors of the client libraries themselves (a reset connection, a 5xx answer) that are not
# OSErrors: transient unless they carry a 4xx status.
_CLIENT_PACKAGES = ("aiohttp", "botocore", "aiobotocore", "gcsfs", "google", "requests",
                    "urllib3", "s3fs")
# tensorstore's status codes (absl's) of a failure that trying again may fix.
_TENSORSTORE_RETRIED = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED",
                        "INTERNAL", "UNKNOWN")
_RETRIED_4XX = (408, 429)  # request timeout, too many requests: the server asks for a retry


class Unreachable(RuntimeError):
    """The store did not answer within the retry budget; the message is one line, and
    `reason` is the last error's first line."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _status(error: BaseException) -> int | None:
    for e in (error, error.__cause__):
        code = getattr(e, "code", None) or getattr(e, "status", None)
        if isinstance(code, int) and 100 <= code < 600:
            return code
    return None


def transient(error: BaseException) -> bool:
    """Whether trying `error`'s request again may succeed (module docstring)."""
    if isinstance(error, ValueError) and str(error).split(":", 1)[0] in _TENSORSTORE_RETRIED:
        return True  # tensorstore says what failed by status code, in a ValueError
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError,
                          NotADirectoryError, FileExistsError, ValueError, TypeError)):
        return False
    if isinstance(error, OSError) and error.errno == errno.EINVAL:  # s3fs: a bad range
        return False
    status = _status(error)
    if status is not None and 400 <= status < 500:
        return status in _RETRIED_4XX
    if isinstance(error, (OSError, asyncio.TimeoutError)):  # reset, refused, timed out
        return True
    return status is not None or type(error).__module__.split(".")[0] in _CLIENT_PACKAGES


def env_number(name: str, default: float, unit: str = "seconds") -> float:
    """A positive number (of `unit`) from the environment variable `name`, else `default`;
    ConfigError (one line) for anything else."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw}: must be a number of {unit} > 0")
    return value


def budget_s() -> float:
    return env_number(RETRY_ENV, BUDGET_S)


def stall_s() -> float:
    return env_number(STALL_ENV, STALL_S)


@contextlib.contextmanager
def watch(what: str, say, every_s: float | None = None, going_on=lambda: "training goes on"):
    """While the block runs, says every `every_s` seconds that `what` has waited so long
    (a stall seen as it happens), and `going_on()`: what the run does meanwhile; nothing
    when the block ends sooner."""
    every = stall_s() if every_s is None else every_s
    done = threading.Event()
    began = time.monotonic()

    def report() -> None:
        while not done.wait(every):
            waited = time.monotonic() - began
            how_long = f"{waited:.0f}s" if waited >= 10 else f"{waited:.1f}s"
            say(f"jaxtrain: {what}: the store has not answered for {how_long}; still trying "
                f"({going_on()})")

    thread = threading.Thread(target=report, name="jaxtrain-stall-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def call(attempt, what: str, *, budget: float | None = None, say=None,
         user_error=None, first_delay_s: float = FIRST_DELAY_S):
    """attempt(timeout_s) until it returns, the policy of the module docstring: a permanent
    error is raised at once (as `user_error(e)` when that gives a one-line error), a
    transient one is tried again while the budget lasts, then Unreachable. `timeout_s` is
    what is left of the budget: an attempt that hangs is cut off there. `say`: where the
    stall reports go (none without it)."""
    budget = budget_s() if budget is None else budget
    deadline = time.monotonic() + budget
    delay = first_delay_s
    with watch(what, say) if say is not None else contextlib.nullcontext():
        while True:
            try:
                return attempt(max(deadline - time.monotonic(), 1.0))
            except Exception as e:
                if user_error is not None and (mine := user_error(e)) is not None:
                    raise mine from e
                if not transient(e):
                    raise
                if time.monotonic() + delay > deadline:
                    reason = _first_line(e)
                    raise Unreachable(f"{what} failed ({reason}); retried for {budget:g}s "
                                      f"(${RETRY_ENV})", reason) from e
                time.sleep(delay)
                delay = min(2 * delay, MAX_DELAY_S)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
