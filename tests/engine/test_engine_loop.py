"""The engine loop's published stats say which calls they count (``WorkerStats.taken_at``),
which failing calls end the loop, and when a loop that stops coming round is stuck."""

from __future__ import annotations

import re
import threading
import time

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import (
    RECENT_STEPS,
    STEP_BOUND_FLOOR_S,
    STEP_BOUND_MULTIPLE,
    EngineBrokenError,
    EngineDeadError,
    EngineLoop,
    EngineStalledError,
    StepBound,
)
from pdserve.testing.waits import wait_for
from pdserve.worker_api import StepDeltas, WorkerStats


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


BOUND_S = 0.5  # the step bound of the stuck-loop tests


def _stats() -> WorkerStats:
    return WorkerStats("w", "colocated", 8, 8, 0, 0, 0, 0, 0, 0, 0, 0, taken_at=time.time())


def test_a_step_past_its_bound_makes_the_loop_not_ready_until_it_ends():
    """A step that runs past ``step_timeout_s`` (a hung collective, a stopped rank) makes the
    loop stuck: ``failure`` and the published stats say so, naming the step's time and the
    bound, and calls are refused at once. The verdict is final: when the step returns, the calls
    accepted before it run, then the loop dies, so its requests end and move."""
    release, stepping = threading.Event(), threading.Event()
    events: list[str] = []

    def step() -> StepDeltas:
        stepping.set()
        release.wait(10)
        return StepDeltas()

    loop = EngineLoop("test-loop", step, lambda: True, stats=_stats, on_death=events.append,
                      step_timeout_s=BOUND_S).start()
    try:
        assert stepping.wait(5)
        accepted = loop.call(events.append, "accepted")  # queued within the bound
        wait_for(lambda: loop.failure is not None, 10, "the stuck verdict")
        assert re.fullmatch(r"stuck: a step has run \d+\.\d s, past the step bound of 0\.5 s "
                            r"\(--step-timeout-s\)", loop.failure), loop.failure
        assert not loop.is_alive and loop.snapshot().error.startswith("stuck: a step has run")
        refused = loop.call(events.append, "refused")
        assert refused.done() and isinstance(refused.exception(), EngineStalledError)
        assert "past the step bound of 0.5 s" in str(refused.exception())
        assert not accepted.done() and events == []
        release.set()
        wait_for(lambda: len(events) == 2, 10, "the loop's death")
        assert accepted.done() and accepted.exception() is None
        assert events[0] == "accepted"  # ran before on_death, which fails its request too
        assert re.fullmatch(r"engine loop died: EngineStalledError: stuck: a step ran \d+\.\d s, "
                            r"past the step bound of 0\.5 s \(--step-timeout-s\)", events[1])
        assert "EngineStalledError" in loop.snapshot().error
        assert isinstance(loop.call(events.append, "late").exception(5), EngineDeadError)
    finally:
        release.set()
        loop.stop()


def test_a_call_that_never_returns_stops_the_loop_draining_its_queue():
    """A call that blocks keeps the loop from its queue as a stuck step does: it is named."""
    release = threading.Event()

    def blocks() -> None:
        release.wait(10)

    loop = EngineLoop("test-loop", StepDeltas, lambda: False, step_timeout_s=BOUND_S).start()
    try:
        loop.call(blocks)
        wait_for(lambda: loop.failure is not None, 10, "the stuck verdict")
        assert "a call to test_a_call_that_never_returns_stops_the_loop_draining_its_queue" \
               ".<locals>.blocks has run" in loop.failure
        assert isinstance(loop.call(lambda: None).exception(0), EngineStalledError)
    finally:
        release.set()
        loop.stop()


def test_an_idle_loop_or_steps_under_the_bound_are_never_stuck():
    """Waiting for calls is not work, and steps that each finish in time never add up."""
    steps = [0]

    def step() -> StepDeltas:
        steps[0] += 1
        time.sleep(BOUND_S / 10)  # 15 of them outlast the bound
        return StepDeltas()

    idle = EngineLoop("idle-loop", StepDeltas, lambda: False, step_timeout_s=BOUND_S).start()
    busy = EngineLoop("busy-loop", step, lambda: steps[0] < 15, step_timeout_s=BOUND_S).start()
    try:
        wait_for(lambda: steps[0] == 15 and busy.busy_since is None, 20, "15 steps")
        assert idle.failure is None and busy.failure is None
        assert idle.call(lambda: "ran").result(5) == "ran"
        assert busy.call(lambda: "ran").result(5) == "ran"
    finally:
        idle.stop()
        busy.stop()


def test_the_derived_bound_follows_the_slowest_recent_step():
    bound = StepBound()
    assert bound.seconds == STEP_BOUND_FLOOR_S  # nothing measured yet
    bound.observe(0.5)
    assert bound.seconds == STEP_BOUND_FLOOR_S  # 10 x 0.5 s is under the floor
    bound.observe(9.0)
    assert bound.seconds == pytest.approx(STEP_BOUND_MULTIPLE * 9.0)
    assert "slowest recent step, 9.000 s" in bound.describe()
    for _ in range(RECENT_STEPS):  # the slow step leaves the window
        bound.observe(0.1)
    assert bound.seconds == STEP_BOUND_FLOOR_S
    fixed = StepBound(2.5)
    fixed.observe(100.0)
    assert fixed.seconds == 2.5 and fixed.describe() == "2.5 s (--step-timeout-s)"


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "30"])
def test_a_bad_step_timeout_is_refused_naming_the_field(value, tmp_path):
    with pytest.raises(ValueError, match="step_timeout_s must be a positive number"):
        EngineConfig(model=str(tmp_path), step_timeout_s=value)
    with pytest.raises(ValueError, match="step_timeout_s"):
        StepBound(value)
