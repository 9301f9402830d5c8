"""The one retry policy (jaxtrain/retry.py): its classifier, its budget, its stall reports."""

import errno
import time

import pytest

from jaxtrain import retry
from jaxtrain.errors import ConfigError


class _Http(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


@pytest.mark.parametrize("error, transient", [
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), True),
    (ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (TimeoutError("timed out"), True),
    (_Http(503), True), (_Http(500), True), (_Http(429), True), (_Http(408), True),
    (FileNotFoundError("s3://b/k"), False), (PermissionError("denied"), False),
    (_Http(404), False), (_Http(400), False), (_Http(412), False),
    (OSError(errno.EINVAL, "bad range"), False), (ValueError("bad"), False),
    (RuntimeError("a bug of ours"), False),
])
def test_one_classifier_of_transient_and_permanent(error, transient):
    assert retry.transient(error) is transient


def test_the_remote_readers_ask_the_same_classifier():
    from jaxtrain.data import remote_file
    for error in (ConnectionResetError(), _Http(503), FileNotFoundError(), _Http(404),
                  ValueError()):
        assert remote_file._permanent(error) is not retry.transient(error)


@pytest.mark.parametrize("message, transient", [
    ("UNAVAILABLE: connection refused", True), ("DEADLINE_EXCEEDED: ...", True),
    ("NOT_FOUND: NoSuchBucket", False), ("OUT_OF_RANGE: Requested byte range", False),
    ("PERMISSION_DENIED: ...", False)])
def test_tensorstore_says_by_status_code_whether_to_try_again(message, transient):
    """The checkpoints' kvstores (tensorstore) raise ValueError with absl's status code."""
    assert retry.transient(ValueError(message)) is transient


class _Clock:
    """monotonic() and sleep() for retry.call: a sleep moves the clock, nothing waits."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_transient_errors_are_retried_within_the_budget_then_one_line(monkeypatch):
    calls = []

    def refused(timeout):
        calls.append(timeout)
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    clock = _Clock()
    monkeypatch.setattr(retry, "time", clock)  # the policy's own clock: no host timing
    with pytest.raises(retry.Unreachable) as gave_up:
        retry.call(refused, "writing s3://b/k", budget=0.35, first_delay_s=0.1)
    # Tried at 0, 0.1 and 0.3 s; a third pause (0.4 s) would pass the budget.
    assert clock.slept == [0.1, 0.2] and len(calls) == 3
    assert str(gave_up.value) == ("writing s3://b/k failed (ConnectionRefusedError: [Errno "
                                  "111] Connection refused); retried for 0.35s "
                                  "($JAXTRAIN_STORAGE_RETRY_S)")
    outcomes = iter([ConnectionResetError(), None])

    def flaky(timeout):
        error = next(outcomes)
        if error:
            raise error
        return "stored"

    assert retry.call(flaky, "x", budget=5, first_delay_s=0.01) == "stored"
    with pytest.raises(FileNotFoundError):  # permanent: at once
        retry.call(lambda t: (_ for _ in ()).throw(FileNotFoundError("k")), "x", budget=5)


def test_a_stall_is_said_while_it_lasts(monkeypatch):
    monkeypatch.setenv(retry.STALL_ENV, "0.1")
    said = []
    retry.call(lambda timeout: time.sleep(0.35), "writing s3://b/k", budget=5,
               say=said.append)
    assert len(said) >= 2 and said[0] == ("jaxtrain: writing s3://b/k: the store has not "
                                          "answered for 0.1s; still trying (training goes on)")


@pytest.mark.parametrize("name", [retry.RETRY_ENV, retry.STALL_ENV])
def test_bad_times_are_one_line(monkeypatch, name):
    monkeypatch.setenv(name, "soon")
    with pytest.raises(ConfigError) as e:
        retry.budget_s() if name == retry.RETRY_ENV else retry.stall_s()
    assert str(e.value) == f"{name}=soon: must be a number of seconds > 0"


def test_in_use_and_a_lost_lease_exit_75_and_config_errors_2(capsys):
    """What the launchers read: guarded (every command's wrapper) exits 75 for a workdir in
    use or a lost lease (retried after the takeover time), 2 for a config error."""
    from jaxtrain.commands.common import guarded
    from jaxtrain.errors import IN_USE, LeaseLost, WorkdirBusy

    for error, code in ((WorkdirBusy("--workdir=x is in use by pid 1"), IN_USE),
                        (LeaseLost("--workdir=x: lost the lease"), IN_USE),
                        (ConfigError("steps=-1 is invalid"), 2)):
        def fail(error=error):
            raise error
        with pytest.raises(SystemExit) as exited:
            guarded(fail)()
        assert exited.value.code == code
        assert capsys.readouterr().err == f"jaxtrain: error: {error}\n"
    assert IN_USE == 75
