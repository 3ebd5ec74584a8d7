"""The engine loop's published stats say which calls they count (``WorkerStats.taken_at``),
and which failing calls end the loop."""

from __future__ import annotations

import threading
import time

from pdserve.engine.engine_loop import EngineBrokenError, EngineDeadError, EngineLoop
from pdserve.engine.protocol import StepDeltas, WorkerStats


def test_published_stats_count_every_call_received_before_taken_at():
    received: list[int] = []
    stepping = threading.Event()

    def step() -> StepDeltas:
        stepping.set()
        time.sleep(0.2)
        return StepDeltas()

    def stats() -> WorkerStats:  # num_waiting: the calls the loop has run (taken now, as
        # engine_stats does; the loop corrects taken_at for what it publishes)
        return WorkerStats("w", "prefill", 8, 8, 0, 0, 0, len(received), 0, 0, 0, 0,
                           taken_at=time.time())

    loop = EngineLoop("test-loop", step, lambda: True, stats=stats, stats_interval_s=0.0).start()
    try:
        assert stepping.wait(5)
        stepping.clear()
        assert stepping.wait(5)  # a step has just begun: the call below waits for its end
        sent_at = time.time()
        done = loop.call(received.append, 1)
        seen, deadline = [], time.monotonic() + 5
        while time.monotonic() < deadline and (not seen or seen[-1].num_waiting == 0):
            seen.append(loop.snapshot())  # until stats count the call
            time.sleep(0.005)
        done.result(5)
    finally:
        loop.stop()
    # the stats published at the end of the step the call arrived in were taken after it was
    # sent, but before the loop ran it: their taken_at is when the loop last ran its calls
    assert any(s.num_waiting == 0 and s.taken_at < sent_at for s in seen)
    assert all(s.num_waiting == 1 for s in seen if s.taken_at >= sent_at)


def test_a_call_that_breaks_the_engine_ends_the_loop_others_do_not():
    """A call raising EngineBrokenError (a tensor parallel rank gone) fails that call and kills
    the loop, so the worker is replaced; any other error only fails its call."""
    deaths: list[str] = []
    loop = EngineLoop("test-loop", StepDeltas, lambda: False, on_death=deaths.append).start()
    try:
        def fails():
            raise ValueError("a bad request")

        def breaks():
            raise EngineBrokenError("rank 1 is gone")

        assert isinstance(loop.call(fails).exception(5), ValueError)
        assert loop.is_alive and deaths == []
        assert isinstance(loop.call(breaks).exception(5), EngineBrokenError)
        deadline = time.monotonic() + 5
        while loop.is_alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not loop.is_alive and "rank 1 is gone" in deaths[0]
        assert isinstance(loop.call(fails).exception(5), EngineDeadError)
    finally:
        loop.stop()


def test_a_part_gone_while_a_step_waits_on_it_shows_at_once_then_ends_the_loop():
    """``watch`` names a part the engine needs that is gone (a dead tensor parallel rank):
    ``failure`` says so while the step that waits on it is still running (the liveness check
    fails, the worker is replaced), and the loop dies before its next step."""
    gone: list[str] = []
    release, stepping = threading.Event(), threading.Event()
    deaths: list[str] = []

    def step() -> StepDeltas:
        stepping.set()
        release.wait(10)
        return StepDeltas()

    loop = EngineLoop("test-loop", step, lambda: True, on_death=deaths.append,
                      watch=lambda: gone[0] if gone else None).start()
    try:
        assert stepping.wait(5) and loop.is_alive and loop.failure is None
        gone.append("tensor parallel rank 1 exited: killed by SIGKILL")
        assert not loop.is_alive and loop.failure == gone[0]  # the step has not returned
        release.set()
        deadline = time.monotonic() + 5
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.01)
        assert deaths and "rank 1 exited" in deaths[0]
        assert "EngineBrokenError" in loop.error
        assert isinstance(loop.call(lambda: None).exception(5), EngineDeadError)
    finally:
        loop.stop()


class _SlowPut:
    """A call queue whose first ``put`` is overtaken by the loop's death: it waits (up to 2 s)
    for the loop thread to end before queueing, as a caller preempted between its check and
    its put would."""

    def __init__(self, inner, loop_thread: threading.Thread, entered: threading.Event):
        self._inner, self._thread, self._entered = inner, loop_thread, entered
        self._first = True

    def put(self, item) -> None:
        if self._first and item is not None:
            self._first = False
            self._entered.set()
            self._thread.join(2.0)
        self._inner.put(item)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_call_that_races_the_loops_death_still_fails():
    """A call queued while the loop dies is failed by the loop's last drain, never left
    pending (the router would wait on it forever)."""
    entered = threading.Event()

    def step() -> StepDeltas:
        raise RuntimeError("the step broke")

    loop = EngineLoop("test-loop", step, entered.is_set)
    loop._calls = _SlowPut(loop._calls, loop._thread, entered)
    loop.start()
    try:
        call = loop.call(lambda: "ran")
        assert isinstance(call.exception(10), EngineDeadError)
    finally:
        loop.stop()
