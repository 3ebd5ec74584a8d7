"""What the decode and colocated workers share: an engine stepping on its own loop thread,
whose deltas the router polls and whose stats it reads."""

from __future__ import annotations

from concurrent.futures import Future

from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.messages import StepDeltas, WorkerStats


class StreamingWorker:
    """A worker whose ``engine`` steps on ``loop``; subclasses define ``_stats`` (loop thread)."""

    engine: LLMEngine
    loop: EngineLoop

    def poll(self, timeout: float | None = None, compact: bool = False) -> StepDeltas:
        """Deltas produced since the last poll (blocks up to ``timeout`` when none), their text
        made here; ``compact``: a pure decode step's go on as one TokenDeltas (what the
        router's handle ships), else one RequestDelta each."""
        deltas = self.loop.outbox.drain(timeout)
        return self.engine.render_compact(deltas) if compact else self.engine.render(deltas)

    def stats(self) -> Future:
        """Future[WorkerStats], taken on the loop thread."""
        return self.loop.call(self._stats)

    def snapshot(self) -> WorkerStats:
        """The latest published stats, without waiting for the engine loop."""
        return self.loop.snapshot()

    def _stats(self) -> WorkerStats:
        raise NotImplementedError
