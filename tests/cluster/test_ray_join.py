"""Joining an existing Ray cluster retries while the connection fails (the head's client
server still starting, or one client's server failing to start), then names the address.

The real join runs in tests/e2e/test_chart_smoke.py (``ray://`` through the chart's head); here
``ray.init`` is replaced to inject the failures."""

from __future__ import annotations

import pytest

from pdserve.cluster import ray_env


class FlakyRay:
    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def init(self, **kwargs):
        self.calls += 1
        assert kwargs["address"] == "ray://head:10001"
        if self.calls <= self.failures:  # the first failure says nothing, the others why
            raise ConnectionAbortedError("Starting Ray client server failed." * (self.calls > 1))


def test_join_retries_until_the_connection_holds():
    ray = FlakyRay(failures=2)
    assert ray_env._join(ray, "ray://head:10001", timeout_s=5, pause_s=0.01) is ray
    assert ray.calls == 3


def test_join_gives_up_naming_the_address():
    ray = FlakyRay(failures=10**6)
    with pytest.raises(ConnectionError, match="ray://head:10001.*Ray head is running"):
        ray_env._join(ray, "ray://head:10001", timeout_s=0.05, pause_s=0.01)
    assert ray.calls >= 2


def test_join_does_not_retry_other_errors():
    class Broken(FlakyRay):
        def init(self, **kwargs):
            self.calls += 1
            raise ValueError("bad address")

    ray = Broken(0)
    with pytest.raises(ValueError, match="bad address"):
        ray_env._join(ray, "ray://head:10001", timeout_s=5, pause_s=0.01)
    assert ray.calls == 1
