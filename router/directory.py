"""Where the router learns which workers exist and how loaded they are."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from pdserve.engine.protocol import WorkerStats

logger = logging.getLogger(__name__)


class WorkerDirectory(Protocol):
    async def snapshot(self) -> list[tuple[object, WorkerStats]]:
        """(handle, latest stats) of every live worker."""
        ...


class StaticDirectory:
    """A fixed set of handles whose stats are asked for directly (in-process, tests)."""

    def __init__(self, handles: list, timeout_s: float = 5.0):
        self.handles = list(handles)
        self.timeout_s = timeout_s

    async def snapshot(self) -> list[tuple[object, WorkerStats]]:
        results = await asyncio.gather(
            *(asyncio.wait_for(h.stats(), self.timeout_s) for h in self.handles),
            return_exceptions=True)
        live = []
        for handle, stats in zip(self.handles, results, strict=True):
            if isinstance(stats, BaseException):
                logger.warning("worker %s did not answer stats: %s", handle.worker_id, stats)
            else:
                live.append((handle, stats))
        return live
