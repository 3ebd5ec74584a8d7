from __future__ import annotations

import pytest

from pdserve.cluster.record_auth import RecordAuth
from pdserve.cluster.redis_server import RedisServer

AUTH = RecordAuth("test-cluster-key")  # the cluster's key of the registries and streams here


@pytest.fixture(scope="session")
def redis_url():
    with RedisServer() as server:
        yield server.url


class Remote:
    """An actor method for fakes of worker actors: ``.remote()`` returns an awaitable, as
    Ray's does."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)
