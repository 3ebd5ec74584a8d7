"""The router's Prometheus endpoint: the text format on its own port (``--metrics-port``).

With an admin key (``pdserve.router.auth``) every scrape must send ``Authorization: Bearer
KEY``, as Prometheus does with ``authorization: {credentials_file: FILE}`` in its scrape config;
any other request is 401. Without one it is open, as a plain Prometheus exporter is. Served by
a threading WSGI server (prometheus_client's WSGI app behind the key check) on a socket bound to
exactly ``host``, in a daemon thread; requests are logged at DEBUG, never to stderr.
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from pdserve.router.auth import Access

logger = logging.getLogger(__name__)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        logger.debug("metrics %s: " + format, self.client_address[0], *args)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


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


def start_metrics_server(registry: CollectorRegistry, port: int, host: str = "127.0.0.1",
                         admin_api_key: str | None = None
                         ) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` on exactly ``host``:``port`` (0: any free port) until
    ``server.shutdown()``; returns (server, thread); ``server.server_port`` is the bound port."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_ThreadingServer,), {"address_family": family})
    server = make_server(host, port, metrics_app(registry, Access(admin_key=admin_api_key)),
                         server_class, _QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="pdserve-metrics", daemon=True)
    thread.start()
    return server, thread
