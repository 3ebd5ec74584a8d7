"""The ASGI pieces under the HTTP front door (``pdserve.router.http_server``): raw response
writers, the disconnect watch, the guard middleware (API key and caller, body bound), the
HTTP/1.1 protocol that bounds how long reading a request may take (:class:`ReadBoundProtocol`)
and a uvicorn server that leaves the hosting process's signals alone, on a socket bound to
exactly one host."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable

import grpc
import h11
import uvicorn
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve import net
from pdserve.router import openai_protocol as oa
from pdserve.router.auth import CALLER, Access

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/version"})  # served without the API key
# operator calls: the admin key (or, without one, loopback callers only), never an API key
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
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
    :class:`~pdserve.router.auth.Caller` it sets in ``auth.CALLER`` for the app, the admin
    key on ADMIN_PATHS (as gRPC Admin: ``Access.admin_refusal``), and the body size bound."""

    class _TooLarge(Exception):
        pass

    def __init__(self, app, access: Access, max_body_bytes: int) -> None:
        self.app, self.access, self.max_body_bytes = app, access, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if scope["path"] in ADMIN_PATHS:
            refusal = self._admin_refusal(scope, headers.get(b"authorization"))
            if refusal is not None:
                return await send_json(send, refusal.status, refusal.body(),
                                       [(b"www-authenticate", b"Bearer")])
            caller = None
        else:
            caller = self.access.inference_caller(headers.get(b"authorization"))
        if caller is None and scope["path"] not in OPEN_PATHS | ADMIN_PATHS:
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

    def _admin_refusal(self, scope, authorization: bytes | None) -> oa.OpenAIError | None:
        """401/403 for an admin path the caller may not use; None: allowed."""
        host, _port = scope.get("client") or ("", 0)
        peer = f"ipv6:[{host}]:0" if ":" in host else f"ipv4:{host}:0"
        refusal = self.access.admin_refusal(authorization, peer)
        if refusal is None:
            return None
        code, message = refusal
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return oa.OpenAIError(401, message.replace("metadata 'authorization:",
                                                       "'Authorization:"),
                                  "authentication_error", code="invalid_api_key")
        return oa.OpenAIError(403, message, "permission_error", code="admin_key_required")

    async def _too_large(self, send) -> None:
        error = oa.OpenAIError(413, f"request body larger than {self.max_body_bytes} bytes",
                               code="request_too_large")
        await send_json(send, 413, error.body())


class ReadBoundProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a bound on reading each request: its head and body
    must have arrived ``read_timeout_s`` after the connection opened (its first request) or
    after the request's first byte (a later one on a kept-alive connection). Past that the
    client gets a 408 (when nothing was answered yet) and the connection closes.

    This runs before the app, so before the API key check: a client that trickles a header
    byte at a time, or never sends one, holds its connection (one of uvicorn's
    ``limit_concurrency``, which counts open connections) for ``read_timeout_s`` at most.
    Between requests uvicorn's ``timeout_keep_alive`` closes an idle connection; the head's
    size is bounded by h11 (``h11_max_incomplete_event_size``) and the body's by
    :class:`Guard`."""

    def __init__(self, *args, read_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_timeout_s = read_timeout_s
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # a request is arriving
            self._arm()
        super().data_received(data)
        self._disarm_if_read()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY:  # a pipelined request's body is pending
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self._read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    @property
    def _reading(self) -> bool:
        """Is a request (or the first one) still arriving on an open connection?"""
        return (not self.transport.is_closing()
                and self.conn.their_state in (h11.IDLE, h11.SEND_BODY))

    def _disarm_if_read(self) -> None:
        if not self._reading:
            self._disarm()

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self._reading:
            return
        logger.info("%s sent no whole request within %g s: closing its connection",
                    self.client, self._read_timeout_s)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # nothing answered yet
            self.transport.write(_request_timeout(self._read_timeout_s))
        self.transport.close()


def _request_timeout(read_timeout_s: float) -> bytes:
    """A raw 408 in the OpenAI error envelope (h11 sends no response before a request head)."""
    error = oa.OpenAIError(408, f"the request did not arrive whole within {read_timeout_s:g} s",
                           code="request_timeout")
    data = json.dumps(error.body(), separators=(",", ":")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(data)).encode() + b"\r\n\r\n"
            + data)


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
