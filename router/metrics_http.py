"""The router's Prometheus endpoint: the text format on its own port (``--metrics-port``).

With an admin key (``pdserve.router.auth``) every scrape must send ``Authorization: Bearer
KEY``, as Prometheus does with ``authorization: {credentials_file: FILE}`` in its scrape config;
any other request is 401. Without one it is open, as a plain Prometheus exporter is.

Served by :class:`MetricsServer` (prometheus_client's WSGI app behind the key check) on a socket
bound to exactly ``host``: one daemon thread running an asyncio loop of its own, never the
router's. A connection costs a socket, not a thread, and is bounded three ways:

1. Its request head (at most ``MAX_HEAD_BYTES``) must arrive within ``request_timeout_s`` of the
   connection opening, and the answer be taken within the same time; otherwise the connection
   is closed. A silent or trickling client is dropped.
2. At most ``max_connections`` are open at once. One more closes the oldest connection still
   waiting for its request head (or, when every open one is being answered, is closed itself),
   so a client opening many idle connections cannot keep a scrape from being answered.
3. One request per connection (``Connection: close``); a request body is never read.

The app runs on the server's thread, one scrape at a time. Requests are logged at DEBUG.
"""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import threading
import time
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_wsgi_app

from pdserve import net
from pdserve.router.auth import Access

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # a connection's whole request, and the answer, within this
MAX_CONNECTIONS = 64  # open at once
MAX_HEAD_BYTES = 8192  # request line and headers


def metrics_app(registry: CollectorRegistry, access: Access):
    """prometheus_client's WSGI app, answering 401 to a scrape without the admin key (when
    ``access`` has one)."""
    app = make_wsgi_app(registry)

    def guarded(environ, start_response):
        if not access.metrics_allowed(environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", "Bearer")])
            return [b"missing or wrong admin key: send 'Authorization: Bearer <admin key>'\n"]
        return app(environ, start_response)

    return guarded


class BadRequest(Exception):
    """A request head that does not parse; answered 400."""


def wsgi_environ(head: bytes, server_address: tuple) -> dict:
    """The WSGI environ of one request head (request line and headers, CRLF-separated, without
    the blank line); BadRequest when it does not parse."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest("the request line must be 'METHOD TARGET HTTP/1.x'") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest(f"unsupported protocol {version!r}")
    path, _, query = target.partition("?")
    environ = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path), "QUERY_STRING": query,
               "SCRIPT_NAME": "", "SERVER_NAME": str(server_address[0]),
               "SERVER_PORT": str(server_address[1]), "SERVER_PROTOCOL": version,
               "wsgi.version": (1, 0), "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(),
               "wsgi.errors": sys.stderr, "wsgi.multithread": False,
               "wsgi.multiprocess": False, "wsgi.run_once": False}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise BadRequest(f"malformed header line {line[:40]!r}")
        key = name.upper().replace("-", "_")
        if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            key = "HTTP_" + key
        environ[key] = value.strip()
    return environ


def wsgi_response(app, environ: dict) -> bytes:
    """Run ``app`` on ``environ``; the whole HTTP/1.1 response, to be followed by a close."""
    started: list = []

    def start_response(status, headers, exc_info=None):
        started[:] = [status, headers]

    chunks = app(environ, start_response)
    try:
        body = b"".join(chunks)
    finally:
        if hasattr(chunks, "close"):
            chunks.close()
    status, headers = started
    return _response(status, headers, b"" if environ["REQUEST_METHOD"] == "HEAD" else body,
                     len(body))


def _response(status: str, headers: list, body: bytes, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{name}: {value}" for name, value in headers
              if name.lower() not in ("content-length", "connection")]
    lines += [f"Content-Length: {len(body) if length is None else length}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _plain(status: str, message: str) -> bytes:
    return _response(status, [("Content-Type", "text/plain; charset=utf-8")],
                     message.encode() + b"\n")


class MetricsServer:
    """Serves a WSGI ``app`` on a listening socket, bounded as the module docstring says:
    ``serve_forever`` in one thread, ``shutdown`` from another, then ``server_close``."""

    def __init__(self, app, sock, *, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._app, self._sock = app, sock
        self.request_timeout_s, self.max_connections = request_timeout_s, max_connections
        self.server_address = sock.getsockname()
        self.server_port: int = self.server_address[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving, self._stopped = threading.Event(), threading.Event()
        self._num_open = 0  # connections being read or answered
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # no request head yet, oldest first

    @property
    def num_connections(self) -> int:
        return self._num_open

    def serve_forever(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._stopped.set()

    def wait_serving(self, timeout: float) -> bool:
        """Whether it accepts connections, waiting up to ``timeout`` s (False: it stopped or
        has not started)."""
        deadline = time.monotonic() + timeout
        while not self._serving.wait(0.01):
            if self._stopped.is_set() or time.monotonic() > deadline:
                return False
        return not self._stopped.is_set()

    def shutdown(self) -> None:
        """Stop serving (open connections are cut) and wait until ``serve_forever`` returns."""
        if self._serving.is_set() and not self._stopped.is_set():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has just closed
                pass
            self._stopped.wait()

    def server_close(self) -> None:
        self._sock.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        server = await asyncio.start_server(self._handle, sock=self._sock, limit=MAX_HEAD_BYTES)
        self._serving.set()
        try:
            await self._stop.wait()
        finally:
            server.close()  # asyncio.run then cancels the connections' tasks

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._num_open >= self.max_connections:
            if not self._waiting:  # every open connection is being answered: refuse this one
                writer.transport.abort()
                return
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.transport.abort()  # its task ends on the lost connection
        self._num_open += 1
        self._waiting[writer] = None
        peer = writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(self.request_timeout_s):
                await self._answer(reader, writer, peer)
        except TimeoutError:
            logger.debug("metrics %s: no whole request (or answer taken) within %g s; closed",
                         peer, self.request_timeout_s)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away (or was closed as the oldest idle one)
        except Exception:
            logger.exception("metrics: answering %s failed", peer)
        finally:
            self._num_open -= 1
            self._waiting.pop(writer, None)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # an answer the client never took
            else:
                writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      peer) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            response = _plain("431 Request Header Fields Too Large",
                              f"the request head must be at most {MAX_HEAD_BYTES} bytes")
        else:
            self._waiting.pop(writer, None)
            try:
                environ = wsgi_environ(head[:-4], self.server_address)
            except BadRequest as exc:
                response = _plain("400 Bad Request", str(exc))
            else:
                environ["REMOTE_ADDR"] = peer[0] if peer else ""
                logger.debug("metrics %s: %s %s", environ["REMOTE_ADDR"],
                             environ["REQUEST_METHOD"], environ["PATH_INFO"])
                response = wsgi_response(self._app, environ)
        writer.transport.set_write_buffer_limits(high=0)  # drain() waits for every byte
        writer.write(response)
        await writer.drain()


def start_metrics_server(registry: CollectorRegistry, port: int, host: str = "127.0.0.1",
                         admin_api_key: str | None = None, *,
                         request_timeout_s: float = REQUEST_TIMEOUT_S,
                         max_connections: int = MAX_CONNECTIONS
                         ) -> tuple[MetricsServer, threading.Thread]:
    """Serve ``registry`` on exactly ``host``:``port`` (0: any free port) until
    ``server.shutdown()``; returns (server, thread) once it accepts connections;
    ``server.server_port`` is the bound port."""
    sock = net.listening_socket(host, port)
    app = metrics_app(registry, Access(admin_key=admin_api_key))
    server = MetricsServer(app, sock, request_timeout_s=request_timeout_s,
                           max_connections=max_connections)
    thread = threading.Thread(target=server.serve_forever, name="pdserve-metrics", daemon=True)
    thread.start()
    if not server.wait_serving(10.0):
        server.shutdown()
        server.server_close()
        raise RuntimeError(f"the metrics server on {host}:{port} did not start")
    return server, thread
