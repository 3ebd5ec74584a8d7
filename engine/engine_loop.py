"""Runs an engine on its own thread; everything that touches the engine runs on that thread.

Callers (Ray actor methods, the router, tests) submit closures with :meth:`EngineLoop.call`,
which returns a ``concurrent.futures.Future``; the loop runs pending calls, a housekeeping
``tick`` (deadlines, leases), then one step when there is work, then waits. Deltas produced
by steps go to a bounded :class:`DeltaOutbox` that readers drain in batches, so the step loop
never waits on a slow reader; while the outbox is full the loop stops stepping (backpressure).
Who reads it, and what happens to the requests of a reader that went away, is the worker's
business (``streaming_worker.mailboxes``).

Liveness never depends on how long a step takes: after each step and tick the loop publishes
the worker's stats (:meth:`snapshot`), which heartbeats read without waiting for the loop.

A loop that stops coming round is another matter. Each piece of its work (a step, a call, a
tick, taking stats) is bounded by the :class:`StepBound` (``--step-timeout-s``, else derived
from the measured step times). Past it the loop is **stuck** (:meth:`stuck`: a step that waits
on a hung collective or a SIGSTOPped tensor parallel rank, a call that never returns):
:attr:`failure` says so (the worker's ping, so its pool replaces it), the snapshot carries it
(the routers send it nothing new), and calls are refused at once with
:class:`EngineStalledError` instead of queueing behind the stuck work. The verdict is final: if
that work ever returns, the loop runs the calls it accepted before the verdict (the engine is
whole) and then dies as below, so every request the worker holds ends with the reason and
moves.

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
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.worker_api import RequestDelta, StepDeltas, WorkerStats

logger = logging.getLogger(__name__)

FAULT_KINDS = ("raise", "stall")
STEP_BOUND_FLOOR_S = 60.0  # the derived step bound is never lower (a first step may compile)
STEP_BOUND_MULTIPLE = 10.0  # nor lower than this many times the slowest recent step
RECENT_STEPS = 64  # the steps the derived bound looks back on
STEP = "a step"
BETWEEN = "the loop between its steps"  # checking for work, waiting for the outbox


class EngineDeadError(RuntimeError):
    """The worker's engine loop died; it takes no more work and is being replaced."""


class EngineBrokenError(RuntimeError):
    """The engine cannot go on (a tensor parallel rank is gone or disagrees): raised by a
    call, it fails that call and then kills the loop, as a failed step does."""


class EngineStalledError(EngineDeadError):
    """The engine loop is stuck: a step (or a call, or a tick) has run past the step bound. The
    worker takes no new work and is replaced; should that work return, the loop ends."""


class InjectedFault(RuntimeError):
    """Raised by a step on purpose (``EngineLoop.inject_fault``)."""


def check_step_timeout(value) -> None:
    """``step_timeout_s``: None (derived) or a positive number of seconds (``inf``: never)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) \
            or value <= 0:
        raise ValueError("step_timeout_s must be a positive number of seconds (inf: no bound) "
                         f"or None (derived from the measured step time), got {value!r}")


class StepBound:
    """How long one piece of the engine loop's work may run before the loop counts as stuck:
    ``fixed_s`` when given, else ``max(STEP_BOUND_FLOOR_S, STEP_BOUND_MULTIPLE x the slowest of
    the last RECENT_STEPS steps)``: a step that finished under the bound counts; one past it
    ends the loop, so it never raises the bound. :meth:`observe` runs on the loop thread;
    :attr:`seconds` and :meth:`describe` may be read from any."""

    def __init__(self, fixed_s: float | None = None):
        check_step_timeout(fixed_s)
        self.fixed_s = fixed_s
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._slowest = 0.0  # of the recent steps
        self.seconds = STEP_BOUND_FLOOR_S if fixed_s is None else float(fixed_s)

    def observe(self, step_s: float) -> None:
        """A step took ``step_s`` (under the bound)."""
        if self.fixed_s is not None:
            return
        self._recent.append(step_s)
        self._slowest = max(self._recent)
        self.seconds = max(STEP_BOUND_FLOOR_S, STEP_BOUND_MULTIPLE * self._slowest)

    def describe(self) -> str:
        if self.fixed_s is not None:
            return f"{self.seconds:g} s (--step-timeout-s)"
        return (f"{self.seconds:.1f} s (derived: {STEP_BOUND_MULTIPLE:g} x the slowest recent "
                f"step, {self._slowest:.3f} s, and at least {STEP_BOUND_FLOOR_S:g} s; "
                f"--step-timeout-s sets it)")


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
                 stats_interval_s: float = 0.1, outbox_capacity: int = 1 << 16,
                 step_timeout_s: float | None = None):
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
        self.step_bound = StepBound(step_timeout_s)
        # what the loop thread is doing and since when (time.monotonic()); None while it waits
        # for calls (a wait bounded by idle_wait_s) or does not run
        self._work: tuple[str, float] | None = None

    def start(self) -> EngineLoop:
        self._publish(force=True)
        self._thread.start()
        return self

    def call(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on the loop thread; the future holds its result or exception. A
        loop that cannot run it soon (dead, stopped, a part gone, stuck) refuses it at once:
        the future is done, with EngineDeadError (EngineStalledError when stuck)."""
        future: Future = Future()
        with self._calls_lock:
            if self.error is not None:
                future.set_exception(EngineDeadError(f"engine loop died: {self.error}"))
            elif self._stopping.is_set():
                future.set_exception(RuntimeError("engine loop is stopped"))
            elif (gone := self._gone()) is not None:
                future.set_exception(EngineDeadError(f"engine loop {self.name} cannot serve: "
                                                     f"{gone}"))
            elif (stuck := self.stuck()) is not None:
                future.set_exception(EngineStalledError(f"engine loop {self.name} {stuck}"))
            else:
                self._calls.put((fn, args, future))
        return future

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._calls.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def name(self) -> str:
        return self._thread.name

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve: the loop died (:attr:`error`), ``watch`` names a part
        that is gone though a step may still be waiting on it, or the loop is stuck
        (:meth:`stuck`); None while it can."""
        if self.error is not None:
            return self.error
        gone = self._gone()
        return gone if gone is not None else self.stuck()

    def stuck(self) -> str | None:
        """What the loop has been doing past the step bound (a step, a call, a tick), with how
        long and the bound; None while it comes round in time."""
        work = self._work
        if work is None or self.error is not None or not self._thread.is_alive():
            return None
        what, since = work
        running_s = time.monotonic() - since
        if running_s <= self.step_bound.seconds:
            return None
        return (f"stuck: {what} has run {running_s:.1f} s, past the step bound of "
                f"{self.step_bound.describe()}")

    @property
    def busy_since(self) -> float | None:
        """time.monotonic() the running step began (None between steps)."""
        work = self._work
        return work[1] if work is not None and work[0] == STEP else None

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def snapshot(self) -> WorkerStats | None:
        """The stats published after the latest step or tick (no wait on the loop), their
        ``error`` set while the engine cannot serve (:attr:`failure`)."""
        published, failure = self._snapshot, self.failure
        if published is None or failure is None or published.error == failure:
            return published
        return dataclasses.replace(published, error=failure)

    def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        """The next step raises (``"raise"``) or first sleeps ``seconds`` (``"stall"``)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}, got {kind!r}")
        self._fault = _Fault(kind, seconds)

    # -- loop thread ----------------------------------------------------------------------
    def _gone(self) -> str | None:
        return None if self._watch is None else self._watch()

    def _begin(self, what: str) -> None:
        self._work = (what, time.monotonic())

    def _end(self) -> float:
        """The current work is done: how long it ran. Past the step bound the loop is stuck
        for good: EngineStalledError, which ends it."""
        what, since = self._work
        now = time.monotonic()
        self._work = (BETWEEN, now)
        ran_s = now - since
        if ran_s > self.step_bound.seconds:
            raise EngineStalledError(f"stuck: {what} ran {ran_s:.1f} s, past the step bound "
                                     f"of {self.step_bound.describe()}")
        return ran_s

    def _run_calls(self, block: bool) -> None:
        try:
            if block:
                self._work = None  # waiting (at most idle_wait_s) is not work
                item = self._calls.get(timeout=self._idle_wait_s)
            else:
                item = self._calls.get_nowait()
        except queue.Empty:
            self._calls_run_at = time.time()
            return
        finally:
            self._work = (BETWEEN, time.monotonic())
        while item is not None:
            fn, args, future = item
            if future.set_running_or_notify_cancel():
                self._run_call(fn, args, future)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                self._calls_run_at = time.time()
                return

    def _run_call(self, fn: Callable, args: tuple, future: Future) -> None:
        self._begin(f"a call to {getattr(fn, '__qualname__', repr(fn))}")
        try:
            future.set_result(fn(*args))
        except EngineBrokenError as exc:
            future.set_exception(exc)
            raise  # the loop dies: the worker is replaced
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)
        self._end()

    def _run(self) -> None:
        try:
            self._serve()
        except EngineStalledError as exc:
            self._die_stuck(exc)
        except BaseException as exc:  # noqa: BLE001 - a dead loop must be visible
            logger.exception("engine loop %s died", self.name)
            self._die(f"{type(exc).__name__}: {exc}")
        finally:
            self._work = None
            self._fail_pending()

    def _serve(self) -> None:
        last_tick = 0.0
        self._work = (BETWEEN, time.monotonic())
        while not self._stopping.is_set():
            if (gone := self._gone()) is not None:
                raise EngineBrokenError(gone)
            can_step = not self.outbox.is_full
            self._run_calls(block=not (can_step and self._has_work()))
            if self._tick is not None and time.monotonic() - last_tick >= self._idle_wait_s:
                self._begin("a tick")
                self._tick()
                self._end()
                last_tick = time.monotonic()
            if can_step and self._has_work():
                self._begin(STEP)
                self._apply_fault()
                self.outbox.put_many(self._step())
                self.step_bound.observe(self._end())  # (a step past the bound raises first)
            self._begin("taking stats")
            self._publish()
            self._end()

    def _die_stuck(self, exc: EngineStalledError) -> None:
        """Work past the step bound returned: the engine is whole, so the calls accepted before
        the verdict run (a submit adds its request), then the loop dies and fails them all."""
        error = f"{type(exc).__name__}: {exc}"
        logger.error("engine loop %s %s; it ends", self.name, exc)
        self.error = error  # refuses calls from here on
        with self._calls_lock:  # every call accepted before is in the queue now
            pass
        try:
            self._run_calls(block=False)
        except BaseException:  # noqa: BLE001 - the loop dies anyway
            logger.exception("engine loop %s: a call accepted before it was stuck failed",
                             self.name)
        self._die(error)

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
