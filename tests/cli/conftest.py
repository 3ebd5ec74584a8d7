"""What the CLI tests share."""

from __future__ import annotations

import pytest

from pdserve.cli import preflight
from pdserve.cluster.options import ClusterOptions


@pytest.fixture
def no_cluster(monkeypatch):
    """A user error must fail before anything starts: starting one fails the test at once.
    The default gRPC and metrics ports count as free, so a pdserve already serving on this
    machine does not answer in place of the error under test."""
    from pdserve.cluster.launcher import EmbeddedCluster

    def refuse(self):
        raise AssertionError("the CLI started a cluster for a user error")

    defaults = {ClusterOptions.port, ClusterOptions.metrics_port}
    listen = preflight._try_listen

    def listen_unless_a_default(host: str, port: int) -> None:
        if port not in defaults:
            listen(host, port)

    monkeypatch.setattr(EmbeddedCluster, "start_infra", refuse)
    monkeypatch.setattr(preflight, "_try_listen", listen_unless_a_default)
