"""--routers N on one local node: N routers cannot share a fixed port, so the settings say so
(naming the flags) before anything starts; free ports, or a joined cluster, are fine."""

from __future__ import annotations

import pytest

from pdserve.cluster.options import ClusterOptions
from pdserve.cluster.settings import Overrides, SettingsError, apply_overrides


def test_several_local_routers_need_free_ports():
    with pytest.raises(SettingsError, match=r"--routers.*--port.*port 50051 twice"):
        apply_overrides(ClusterOptions(), Overrides(cluster={"num_routers": 2}))
    ClusterOptions(num_routers=2, port=0, metrics_port=None)
    ClusterOptions(num_routers=2, ray_address="ray://head:10001")
    with pytest.raises(ValueError, match="num_routers must be >= 1"):
        ClusterOptions(num_routers=0)
