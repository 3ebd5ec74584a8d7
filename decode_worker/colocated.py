"""The colocated worker: one engine does both phases (chunked prefill mixed into decode steps).

It is the baseline every disaggregated figure is measured against, and the fallback for
one-worker setups. Lifecycle: ``submit(request)`` queues the prompt; steps run continuous
batching; deltas (token 0 included) go to the outbox that the router drains with ``poll``;
``abort`` is idempotent.
"""

from __future__ import annotations

from concurrent.futures import Future

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import EngineParts, LLMEngine, engine_stats
from pdserve.engine.messages import RequestDelta, WorkerStats, WorkRequest


class ColocatedWorker:
    role = "colocated"

    def __init__(self, worker_id: str, parts: EngineParts):
        self.worker_id = worker_id
        self.engine = LLMEngine(parts)
        self.loop = EngineLoop(f"colocated-{worker_id}", self.engine.step,
                               self.engine.has_unfinished_requests).start()

    def submit(self, request: WorkRequest) -> Future:
        """Future[None]; raises ValueError when the request can never be served here."""
        return self.loop.call(self.engine.add_request, request.request_id,
                              request.prompt_token_ids, request.params, request.seed)

    def abort(self, request_id: str) -> Future:
        return self.loop.call(self._abort, request_id)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def poll(self, timeout: float | None = None) -> list[RequestDelta]:
        return self.loop.outbox.drain(timeout)

    def stats(self) -> Future:
        return self.loop.call(self._stats)

    def _stats(self) -> WorkerStats:
        return engine_stats(self.worker_id, self.role, self.engine)

    def close(self) -> None:
        self.loop.stop()

