"""Runs an engine on its own thread; everything that touches the engine runs on that thread.

Callers (Ray actor methods, the router, tests) submit closures with :meth:`EngineLoop.call`,
which returns a ``concurrent.futures.Future``; the loop runs pending calls, a housekeeping
``tick`` (deadlines, leases), then one step when there is work, then waits. Deltas produced
by steps go to a bounded :class:`DeltaOutbox` that readers drain in batches, so the step loop
never waits on a slow reader; while the outbox is full the loop stops stepping (backpressure).
Who reads it, and what happens to the requests of a reader that went away, is the worker's
business (``decode_worker.mailboxes``).

Liveness never depends on how long a step takes: after each step and tick the loop publishes
the worker's stats (:meth:`snapshot`), which heartbeats read without waiting for the loop.

If the loop dies (an exception escapes a step, a call raises :class:`EngineBrokenError`, or
``watch`` names a part the engine needs that is gone), ``on_death`` runs once on the loop
thread so the worker can fail every request it holds, :attr:`error` is set, the snapshot
carries the error, pending and later calls fail at once with :class:`EngineDeadError`.
:attr:`failure` reports what ``watch`` names at once, even while a step waits on the part that
is gone (a collective with a dead tensor parallel rank), so the worker's liveness check fails
and the worker is replaced whether or not that step ever returns. ``inject_fault`` makes the
next step raise or stall (tests of these paths on real workers).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.engine.protocol import RequestDelta, StepDeltas, WorkerStats

logger = logging.getLogger(__name__)

FAULT_KINDS = ("raise", "stall")


class EngineDeadError(RuntimeError):
    """The worker's engine loop died; it takes no more work and is being replaced."""


class EngineBrokenError(RuntimeError):
    """The engine cannot go on (a tensor parallel rank is gone or disagrees): raised by a
    call, it fails that call and then kills the loop, as a failed step does."""


class InjectedFault(RuntimeError):
    """Raised by a step on purpose (``EngineLoop.inject_fault``)."""


class DeltaOutbox:
    """Thread-safe bounded buffer of deltas; :meth:`drain` blocks until some arrive or time
    runs out. ``capacity`` bounds what steps add (error deltas may exceed it by one batch)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items = StepDeltas()
        self._cond = threading.Condition()

    def put_many(self, deltas: StepDeltas | list[RequestDelta]) -> None:
        if deltas:
            with self._cond:
                self._items.extend(deltas)
                self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> StepDeltas:
        """What steps put since the last drain (the reader renders them)."""
        with self._cond:
            if not self._items and timeout:
                self._cond.wait(timeout)
            items, self._items = self._items, StepDeltas()
            return items

    @property
    def is_full(self) -> bool:
        return len(self._items) >= self.capacity


@dataclasses.dataclass
class _Fault:
    kind: str  # "raise" | "stall"
    seconds: float = 0.0  # stall length


class EngineLoop:
    """A thread that alternates between queued calls, ``tick()`` and ``step()``."""

    def __init__(self, name: str, step: Callable[[], StepDeltas],
                 has_work: Callable[[], bool], *, tick: Callable[[], None] | None = None,
                 stats: Callable[[], WorkerStats] | None = None,
                 on_death: Callable[[str], None] | None = None,
                 watch: Callable[[], str | None] | None = None, idle_wait_s: float = 0.05,
                 stats_interval_s: float = 0.1, outbox_capacity: int = 1 << 16):
        self.outbox = DeltaOutbox(outbox_capacity)
        self._step = step
        self._has_work = has_work
        self._tick = tick  # periodic housekeeping (deadlines, leases), on the loop thread
        self._stats = stats
        self._on_death = on_death
        self._watch = watch  # why the engine cannot go on though this thread runs, or None
        self._idle_wait_s = idle_wait_s
        self._stats_interval_s = stats_interval_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._calls_lock = threading.Lock()  # a call is queued before the loop's last drain
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._fault: _Fault | None = None
        self._snapshot: WorkerStats | None = None
        self._published_at = 0.0
        self._calls_run_at = 0.0  # wall clock: every call received before it has run
        self.error: str | None = None  # why the loop died (None while it runs)
        self.busy_since: float | None = None  # time.monotonic() the running step began

    def start(self) -> EngineLoop:
        self._publish(force=True)
        self._thread.start()
        return self

    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the loop thread; the future holds its result or exception."""
        future: Future = Future()
        with self._calls_lock:
            if self.error is not None:
                future.set_exception(EngineDeadError(f"engine loop died: {self.error}"))
            elif self._stopping.is_set():
                future.set_exception(RuntimeError("engine loop is stopped"))
            else:
                self._calls.put((fn, args, future))
        return future

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._calls.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve: the loop died (:attr:`error`), or ``watch`` names a
        part that is gone though a step may still be waiting on it; None while it can."""
        if self.error is not None:
            return self.error
        return None if self._watch is None else self._watch()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def snapshot(self) -> WorkerStats | None:
        """The stats published after the latest step or tick (no wait on the loop)."""
        return self._snapshot

    def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """The next step raises (``"raise"``) or first sleeps ``seconds`` (``"stall"``)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}, got {kind!r}")
        self._fault = _Fault(kind, seconds)

    # -- loop thread ----------------------------------------------------------------------
    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self._idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            self._calls_run_at = time.time()
            return
        while item is not None:
            fn, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except EngineBrokenError as exc:
                    future.set_exception(exc)
                    raise  # the loop dies: the worker is replaced
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                self._calls_run_at = time.time()
                return

    def _run(self) -> None:
        last_tick = 0.0
        try:
            while not self._stopping.is_set():
                if self._watch is not None and (gone := self._watch()) is not None:
                    raise EngineBrokenError(gone)
                can_step = not self.outbox.is_full
                self._run_calls(block=not (can_step and self._has_work()))
                if self._tick is not None and time.monotonic() - last_tick >= self._idle_wait_s:
                    self._tick()
                    last_tick = time.monotonic()
                if can_step and self._has_work():
                    self.busy_since = time.monotonic()
                    self._apply_fault()
                    self.outbox.put_many(self._step())
                    self.busy_since = None
                self._publish()
        except BaseException as exc:  # noqa: BLE001 - a dead loop must be visible
            logger.exception("engine loop %s died", self._thread.name)
            self._die(f"{type(exc).__name__}: {exc}")
        finally:
            self._fail_pending()

    def _apply_fault(self) -> None:
        fault, self._fault = self._fault, None
        if fault is None:
            return
        if fault.kind == "stall":
            logger.warning("engine loop %s: injected stall of %.1f s", self._thread.name,
                           fault.seconds)
            time.sleep(fault.seconds)
        else:
            raise InjectedFault("injected engine fault")

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._stats is None or (not force and now - self._published_at < self._stats_interval_s):
            return
        self._snapshot = self._stats()
        if self._calls_run_at:  # a step may have run since: calls received then wait
            self._snapshot.taken_at = self._calls_run_at
        self._published_at = now

    def _die(self, error: str) -> None:
        self.error = error
        if self._snapshot is not None:
            self._snapshot = dataclasses.replace(self._snapshot, error=error)
        if self._on_death is not None:
            try:
                self._on_death(f"engine loop died: {error}")
            except Exception:  # noqa: BLE001 - the loop is already dead
                logger.exception("engine loop %s: on_death failed", self._thread.name)

    def _fail_pending(self) -> None:
        error = (EngineDeadError(f"engine loop died: {self.error}") if self.error is not None
                 else RuntimeError("engine loop stopped"))
        with self._calls_lock:  # error or stopping is set: no call is queued after this
            while True:
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    return
                if item is not None and item[2].set_running_or_notify_cancel():
                    item[2].set_exception(error)
