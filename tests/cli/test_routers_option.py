"""--routers N on one local node: N routers cannot share a fixed port, so the settings say so
(naming the flags) before anything starts; free ports, or a joined cluster, are fine."""

from __future__ import annotations

import pytest

from pdserve.cli.settings import Overrides, SettingsError, apply_overrides
from pdserve.cluster.options import ClusterOptions


def test_several_local_routers_need_free_ports():
    with pytest.raises(SettingsError, match=r"--routers.*--port.*port 50051 twice"):
        apply_overrides(ClusterOptions(), Overrides(cluster={"num_routers": 2}))
    ClusterOptions(num_routers=2, port=0, metrics_port=None)
    ClusterOptions(num_routers=2, ray_address="ray://head:10001")
    with pytest.raises(ValueError, match="num_routers must be >= 1"):
        ClusterOptions(num_routers=0)


def test_free_ports_come_from_below_the_ephemeral_range():
    """A port picked for a server that binds it later must not be one the kernel hands to
    outgoing connections meanwhile (the chart smoke run lost its router port that way)."""
    import socket

    from pdserve.cluster.redis_server import LISTEN_PORTS, free_port

    ports = {free_port() for _ in range(20)}
    assert ports <= set(LISTEN_PORTS)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    assert max(LISTEN_PORTS) < low
    taken = socket.socket()
    taken.bind(("127.0.0.1", ports.pop()))
    try:
        assert taken.getsockname()[1] not in {free_port() for _ in range(50)}
    finally:
        taken.close()
