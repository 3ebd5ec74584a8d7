"""The colocated worker: one engine does both phases (chunked prefill mixed into decode steps).

It is the baseline every disaggregated figure is measured against, and the fallback for
one-worker setups. Lifecycle: ``submit(request, router)`` queues the prompt (plus the outputs
already streamed, for a migrated request), owned by ``router``; steps run continuous batching;
deltas (token 0 included, stamped with the request's attempt) go to the bounded outbox that the
routers drain with ``poll``, each getting its own requests' (``streaming_worker.mailboxes``);
``abort`` is idempotent. A request also ends on its own, with an ``abort`` delta carrying the
error, when its deadline passes, when its router has not polled for ``orphan_timeout_s``
(whatever other routers do), or when the engine loop dies (the worker then refuses new work).
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.worker_stats import engine_stats
from pdserve.streaming_worker.mailboxes import RouterMailboxes
from pdserve.streaming_worker.worker import ForkOwners, StreamingWorker
from pdserve.worker_api import WorkerStats


class ColocatedWorker(StreamingWorker):
    role = "colocated"

    def __init__(self, worker_id: str, parts: EngineParts, orphan_timeout_s: float = 30.0):
        self.worker_id = worker_id
        self.mailboxes = RouterMailboxes()
        self.engine = LLMEngine(parts, hooks=ForkOwners(self.mailboxes))
        self.orphan_timeout_s = orphan_timeout_s
        self.loop = EngineLoop(f"colocated-{worker_id}", self.engine.step,
                               self.engine.has_unfinished_requests, tick=self._tick,
                               stats=self._stats, on_death=self._fail_everything,
                               watch=self.engine.broken,
                               step_timeout_s=parts.config.step_timeout_s)
        self.loop.start()  # (after self.loop is set: the loop's first tick reads it)

    def abort(self, request_id: str) -> Future:
        return self.loop.call(self._abort, request_id)

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()

    # -- loop thread --------------------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        """The router's abort: its final deltas (no error) only end the owner entry."""
        self.loop.outbox.put_many(self.engine.abort_request(request_id))

    def _fail_request(self, request_id: str, error: str) -> None:
        deltas = self.engine.abort_request(request_id)
        for delta in deltas:
            delta.error = error
        self.loop.outbox.put_many(deltas)

    def _stats(self) -> WorkerStats:
        return engine_stats(self.worker_id, self.role, self.engine)

    def _tick(self) -> None:
        self.loop.outbox.put_many(self.engine.expire(time.time()))
        self._free_orphans()

    def _fail_everything(self, error: str) -> None:
        self.loop.outbox.put_many(self.engine.abort_all(error))
