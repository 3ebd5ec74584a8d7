"""The Prometheus port over real loopback HTTP: behind the admin key when the router has one
(a scrape with Prometheus' bearer credentials reads it, anything else is 401), open without;
idle, trickling and surplus connections are closed and never keep a scrape from an answer."""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.error
import urllib.request

import pytest

from pdserve.router.metrics import RouterMetrics
from pdserve.router.metrics_http import start_metrics_server
from pdserve.testing.waits import wait_for

ADMIN = "metrics-admin-key"


def _scrape(port: int, key: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def metrics():
    metrics = RouterMetrics()
    metrics.observe_ttft(0.25)
    return metrics


def test_metrics_need_the_admin_key_when_one_is_set(metrics):
    server, thread = metrics.start_http(0, "127.0.0.1", admin_api_key=ADMIN)
    try:
        port = server.server_port
        for key in (None, "wrong", "inference-key"):
            status, body = _scrape(port, key)
            assert status == 401 and "pdserve_" not in body and "admin key" in body
        status, body = _scrape(port, ADMIN)
        assert status == 200 and "pdserve_time_to_first_token_seconds_count" in body
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_metrics_stay_open_without_an_admin_key(metrics):
    server, thread = metrics.start_http(0, "127.0.0.1")
    try:
        status, body = _scrape(server.server_port, None)
        assert status == 200 and "pdserve_time_to_first_token_seconds_count" in body
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextlib.contextmanager
def _serving(metrics: RouterMetrics, **limits):
    server, thread = start_metrics_server(metrics.registry, 0, "127.0.0.1", **limits)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _closed_by_server(sock: socket.socket, cap_s: float = 10.0) -> bool:
    """Whether the server closes ``sock`` (reads EOF, after any answer) within ``cap_s``."""
    sock.settimeout(cap_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def test_many_idle_connections_never_keep_a_scrape_from_an_answer(metrics):
    """Past max_connections each new connection closes the oldest one still silent, so a
    scrape is answered at once although the idle ones would be kept for a minute."""
    with _serving(metrics, request_timeout_s=60.0, max_connections=4) as server:
        idle = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(12)]
        try:
            status, body = _scrape(server.server_port, None)
            assert status == 200 and "pdserve_time_to_first_token_seconds_count" in body
            assert all(_closed_by_server(sock) for sock in idle[:9])  # the oldest went first
            wait_for(lambda: server.num_connections <= 4, 10, "at most max_connections open")
        finally:
            for sock in idle:
                sock.close()


def test_silent_and_trickling_clients_are_dropped(metrics):
    with _serving(metrics, request_timeout_s=0.5) as server:
        silent = socket.create_connection(("127.0.0.1", server.server_port))
        trickling = socket.create_connection(("127.0.0.1", server.server_port))
        try:
            trickling.sendall(b"GET /metrics HTTP/1.1\r\n")
            sent, trickle = 0, b"X-Slow: " + b"a" * 100  # a byte per 0.2 s: 20 s unless cut off
            for byte in trickle:
                try:
                    trickling.sendall(bytes([byte]))
                except ConnectionError:
                    break
                sent += 1
                time.sleep(0.2)
            assert sent < len(trickle), "a client trickling its request head was never cut off"
            assert _closed_by_server(trickling) and _closed_by_server(silent)
            status, _ = _scrape(server.server_port, None)
            assert status == 200
            wait_for(lambda: server.num_connections == 0, 10, "every connection closed")
        finally:
            silent.close()
            trickling.close()


def test_a_bad_or_oversized_request_head_is_refused(metrics):
    with _serving(metrics) as server:
        for request, status in ((b"NONSENSE\r\n\r\n", b" 400 "),
                                (b"GET / HTTP/1.1\r\nX: " + b"a" * 10_000 + b"\r\n\r\n",
                                 b" 431 ")):
            with socket.create_connection(("127.0.0.1", server.server_port), 10) as sock:
                sock.sendall(request)
                assert status in sock.recv(4096).split(b"\r\n", 1)[0]
