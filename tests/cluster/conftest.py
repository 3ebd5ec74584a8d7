from __future__ import annotations

import pytest

from pdserve.cluster.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_url():
    with RedisServer() as server:
        yield server.url
