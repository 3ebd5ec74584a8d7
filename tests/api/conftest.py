"""A GenerationServer with a FakeBackend running on its own event loop thread, so blocking
clients can call it from the test thread (and asyncio clients from their own loop)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.router.grpc_server import GenerationServer
from pdserve.testing.fake_backend import FakeBackend
from pdserve.testing.waits import wait_for


class BackgroundServer:
    """``server`` serves ``backend`` on 127.0.0.1:``port`` from a daemon thread's loop."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server: GenerationServer = self.call(self._make())
        self.port: int = self.call(self.server.start("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.port}"

    async def _make(self) -> GenerationServer:
        return GenerationServer(self.backend, health_poll_interval_s=0.02)

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def wait_until(self, predicate, what: str, timeout_s: float = 5.0) -> None:
        wait_for(predicate, timeout_s, what, 0.01)

    def close(self) -> None:
        self.call(self.server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def start_server():
    """``start_server(**FakeBackend kwargs) -> BackgroundServer``; stopped after the test."""
    started: list[BackgroundServer] = []

    def start(**backend_kwargs) -> BackgroundServer:
        started.append(BackgroundServer(FakeBackend(**backend_kwargs)))
        return started[-1]

    yield start
    for background in started:
        background.close()
