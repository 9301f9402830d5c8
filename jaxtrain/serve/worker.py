"""The engine's one thread: HTTP handlers queue requests into it, and it admits them into
the continuous batch between decode steps, so concurrent requests share the batch. Each
request's listener hears of its tokens from this thread."""

from __future__ import annotations

import logging
import queue
import threading

from jaxtrain.engine import Engine, Request

log = logging.getLogger("jaxtrain.serve")


class Worker:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="jaxtrain-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, request: Request, listener) -> None:
        """listener(completion, text delta, finished) on the engine thread; on an engine
        failure, listener.fail(message)."""
        self.inbox.put(("submit", request, listener))

    def cancel(self, listener) -> None:
        """Ends the request of `listener` (its client went away): its slots free up."""
        self.inbox.put(("cancel", listener))

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        self.inbox.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while not self.stopping.is_set():
            self._take(block=self.engine.idle())
            if self.stopping.is_set() or self.engine.idle():
                continue
            try:
                self.engine.step()
            except Exception as e:  # a bug: every request in flight hears of it
                log.exception("decode step failed")
                for listener in self.engine.drop_all():
                    listener.fail(f"the engine failed: {type(e).__name__}: {e}")

    def _take(self, block: bool) -> None:
        """Everything queued (waiting for the first item when the engine is idle)."""
        try:
            item = self.inbox.get(block=block)
        except queue.Empty:
            return
        while item is not None:
            if item[0] == "submit":
                _, request, listener = item
                try:
                    self.engine.submit(request, listener)
                except Exception as e:  # checked before queueing; a race is still an answer
                    listener.fail(str(e))
            else:
                self.engine.cancel(item[1])
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
