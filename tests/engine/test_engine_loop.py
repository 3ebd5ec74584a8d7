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
