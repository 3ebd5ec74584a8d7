"""The Prometheus port over real loopback HTTP: behind the admin key when the router has one
(a scrape with Prometheus' bearer credentials reads it, anything else is 401), open without."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from pdserve.router.metrics import RouterMetrics

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
