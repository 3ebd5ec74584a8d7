"""What several router test modules share."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.router.http_server import HttpServer
from pdserve.testing.fake_backend import FakeBackend, FakePromptTools


@pytest.fixture(scope="module")
def fake_http():
    """An HTTP door over a FakeBackend on its own event loop thread; yields (backend, url)."""
    backend = FakeBackend()
    loop = asyncio.new_event_loop()

    async def start() -> HttpServer:
        server = HttpServer(backend, model_root="/models/fake", tools=FakePromptTools(backend))
        await server.start("127.0.0.1", 0)
        return server

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield backend, f"http://127.0.0.1:{server.port}"
    asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
