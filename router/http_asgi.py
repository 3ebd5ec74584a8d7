"""The ASGI pieces under the HTTP front door (``pdserve.router.http_server``): raw response
writers, the disconnect watch, the guard middleware (API key and caller, body bound) and a
uvicorn server that leaves the hosting process's signals alone, on a socket bound to exactly one
host."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn
from starlette.responses import Response

from pdserve import net
from pdserve.router import openai_protocol as oa
from pdserve.router.auth import CALLER, Access

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/version"})  # served without the API key
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


async def until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Guard:
    """ASGI middleware, before parsing: the inference key (except OPEN_PATHS), whose
    :class:`~pdserve.router.auth.Caller` it sets in ``auth.CALLER`` for the app, and the body
    size bound."""

    class _TooLarge(Exception):
        pass

    def __init__(self, app, access: Access, max_body_bytes: int) -> None:
        self.app, self.access, self.max_body_bytes = app, access, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        caller = self.access.inference_caller(headers.get(b"authorization"))
        if caller is None and scope["path"] not in OPEN_PATHS:
            error = oa.OpenAIError(401, "missing or wrong API key: send 'Authorization: "
                                        "Bearer <key>'", "authentication_error",
                                   code="invalid_api_key")
            return await send_json(send, 401, error.body(), [(b"www-authenticate", b"Bearer")])
        CALLER.set(caller)
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            return await self._too_large(send)
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise self._TooLarge()
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except self._TooLarge:
            if not started:
                await self._too_large(send)

    async def _too_large(self, send) -> None:
        error = oa.OpenAIError(413, f"request body larger than {self.max_body_bytes} bytes",
                               code="request_too_large")
        await send_json(send, 413, error.body())


class QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the process that hosts it owns its signals."""

    def capture_signals(self):
        return contextlib.nullcontext()


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking socket listening on exactly ``host``, as uvicorn takes it."""
    sock = net.listening_socket(host, port, backlog=1024)
    sock.setblocking(False)
    return sock


class TaskResponse(Response):
    """Writes the response with ``run(send)``, as its own task beside one that watches for the
    client's disconnect; a disconnect cancels ``run`` (whose ``finally`` cleans up) and the
    response waits for it to end."""

    def __init__(self, run: Callable[[Callable], Awaitable[None]], name: str) -> None:
        super().__init__()
        self._run, self._name = run, name

    async def __call__(self, scope, receive, send) -> None:
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(until_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                logger.info("%s: client gone, aborting", self._name)
                work.cancel()
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.exception("%s failed", self._name)
