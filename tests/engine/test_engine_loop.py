"""The engine loop's published stats say which calls they count (``WorkerStats.taken_at``)."""

from __future__ import annotations

import threading
import time

from pdserve.engine.engine_loop import EngineLoop
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
