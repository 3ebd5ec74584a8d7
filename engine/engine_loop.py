"""Runs an engine on its own thread; everything that touches the engine runs on that thread.

Callers (Ray actor methods, the router, tests) submit closures with :meth:`EngineLoop.call`,
which returns a ``concurrent.futures.Future``; the loop runs pending calls, then one step when
there is work, then waits. Deltas produced by steps go to a :class:`DeltaOutbox` that readers
drain in batches, so the step loop never waits on a slow reader.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.engine.messages import RequestDelta

logger = logging.getLogger(__name__)


class DeltaOutbox:
    """Thread-safe buffer of deltas; :meth:`drain` blocks until some arrive or time runs out."""

    def __init__(self) -> None:
        self._items: list[RequestDelta] = []
        self._cond = threading.Condition()

    def put_many(self, deltas: list[RequestDelta]) -> None:
        if deltas:
            with self._cond:
                self._items.extend(deltas)
                self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> list[RequestDelta]:
        with self._cond:
            if not self._items and timeout:
                self._cond.wait(timeout)
            items, self._items = self._items, []
            return items


class EngineLoop:
    """A thread that alternates between queued calls and ``step()`` while ``has_work()``."""

    def __init__(self, name: str, step: Callable[[], list[RequestDelta]],
                 has_work: Callable[[], bool], idle_tick: Callable[[], None] | None = None,
                 idle_wait_s: float = 0.05):
        self.outbox = DeltaOutbox()
        self._step = step
        self._has_work = has_work
        self._idle_tick = idle_tick  # periodic housekeeping (lease expiry), on the loop thread
        self._idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the loop thread; the future holds its result or exception."""
        future: Future = Future()
        if self._stopping.is_set():
            future.set_exception(RuntimeError("engine loop is stopped"))
            return future
        self._calls.put((fn, args, future))
        return future

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._calls.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self._idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self._has_work()
                self._run_calls(block=not busy)
                if self._idle_tick is not None:
                    self._idle_tick()
                if self._has_work():
                    self.outbox.put_many(self._step())
        except BaseException as exc:  # noqa: BLE001 - a dead loop must be visible
            logger.exception("engine loop %s died", self._thread.name)
            self.error = exc
        finally:
            self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[2].set_running_or_notify_cancel():
                item[2].set_exception(RuntimeError("engine loop stopped"))
