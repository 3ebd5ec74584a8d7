"""Workers, the router's view of its workers: membership from the directory, one poller per
streaming worker, and the difference between leaving the registry (no new requests, streams
go on) and being lost (a failed poll). Handles here are scripted stand-ins (fault injection);
tests/router/test_failover.py and the e2e tests run the same paths over real workers."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from pdserve.router.config import RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import Workers
from pdserve.worker_api import RequestDelta, StepDeltas, WorkerStats


class ScriptedHandle:
    """A worker whose polls return what the test queues (an exception: the poll fails)."""

    def __init__(self, worker_id: str, role: str):
        self.worker_id, self.role = worker_id, role
        self.polls: asyncio.Queue = asyncio.Queue()
        self.aborted: list[str] = []
        self.taken_at = 0.0  # the stats' age (0: unknown)

    async def stats(self) -> WorkerStats:
        return WorkerStats(self.worker_id, self.role, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0,
                           taken_at=self.taken_at)

    async def poll(self, timeout: float):
        item = await self.polls.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def drain_kv_events(self) -> None:
        return None  # no prefix cache (the stats name no KV event log)


def _workers(handles):
    routed, lost = [], []
    workers = Workers(StaticDirectory(handles), RouterConfig(stats_interval_s=3600),
                      RouterMetrics(), lambda handle, delta: routed.append((handle.worker_id,
                                                                           delta)),
                      lambda worker_id, why: lost.append((worker_id, why)))
    return workers, routed, lost


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_membership_streams_and_a_lost_worker():
    async def scenario():
        prefill, decode = ScriptedHandle("p0", "prefill"), ScriptedHandle("d0", "decode")
        workers, routed, lost = _workers([prefill, decode])
        assert not workers.is_ready() and not await workers.wait_ready(0.01)
        await workers.start()
        assert workers.is_ready() and await workers.wait_ready(0)
        assert [w.stats.worker_id for w in workers.live("decode")] == ["d0"]

        # a step's columns reach route() as one RequestDelta per request
        decode.polls.put_nowait(StepDeltas.new_tokens(["a", "b"], [5, 6], [1, 1],
                                                      np.array([3, 3]), np.array([2, 2])))
        await _settle()
        assert [(w, d.request_id, d.new_token_ids) for w, d in routed] == [
            ("d0", "a", [5]), ("d0", "b", [6])]

        # leaving the registry: no new requests, but the stream goes on
        workers.directory.handles.remove(decode)
        await workers.refresh()
        assert workers.live("decode") == [] and not workers.is_ready()
        assert not await workers.wait_ready(0.01)
        decode.polls.put_nowait([RequestDelta("a", [7], "", attempt=1)])
        await _settle()
        assert routed[-1][1].new_token_ids == [7] and lost == []

        # a failed poll loses the worker: its handle goes and the callback hears why
        decode.polls.put_nowait(ConnectionError("actor died"))
        await _settle()
        assert lost == [("d0", "poll failed: actor died")]
        assert "d0" not in workers.handles
        await workers.abort_on("d0", "a")  # a lost worker is not called
        assert decode.aborted == []
        await workers.stop()

    asyncio.run(scenario())


def test_a_suspect_worker_takes_no_new_requests_until_the_next_refresh():
    async def scenario():
        decode = ScriptedHandle("d0", "colocated")
        workers, _routed, lost = _workers([decode])
        await workers.start()
        workers.suspect("d0", "submit failed")
        assert workers.live("colocated") == [] and "d0" in workers.handles
        waiting = asyncio.create_task(workers.wait_ready(30))  # a request waiting for workers
        workers.abort_later("d0", "r1")
        await _settle()
        assert decode.aborted == ["r1"]
        await workers.refresh()
        assert [w.stats.worker_id for w in workers.live("colocated")] == ["d0"] and lost == []
        assert await asyncio.wait_for(waiting, 1)  # woken by the refresh, not its timeout
        await workers.stop()

    asyncio.run(scenario())


def test_stats_taken_before_the_failed_call_do_not_clear_a_suspect():
    """A worker whose engine died is still listed with the stats of its last heartbeat until
    it is replaced: those must not bring it back, or a request's retries all land on it."""
    async def scenario():
        worker = ScriptedHandle("p0", "prefill")
        workers, _routed, _lost = _workers([worker, ScriptedHandle("d0", "decode")])
        worker.taken_at = time.time()
        await workers.start()
        workers.suspect("p0", "prefill failed: engine loop died")
        await workers.refresh()  # the same stats as before the failure
        assert workers.live("prefill") == [] and "p0" in workers.handles
        worker.taken_at = time.time() + 1  # a heartbeat since: it lives
        await workers.refresh()
        assert [w.stats.worker_id for w in workers.live("prefill")] == ["p0"]
        await workers.stop()

    asyncio.run(scenario())
