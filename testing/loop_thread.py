"""An asyncio event loop on a thread of its own, for tests that host a server on it and drive
it from synchronous code."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    """One event loop running in a daemon thread; ``run`` waits for a coroutine on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
