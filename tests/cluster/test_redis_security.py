"""The embedded redis-server: a generated password (never on its command line), loopback only,
URLs printed with the password hidden, and a child that dies with the thread that started it."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import redis

from pdserve.cluster.redis_server import RedisServer, redact_url, url_password, with_password


def test_embedded_redis_requires_its_generated_password():
    with RedisServer() as server, RedisServer() as other:
        assert server.password != other.password and len(server.password) >= 24
        assert server.url.startswith("redis://:") and "@127.0.0.1:" in server.url
        assert redis.Redis.from_url(server.url).ping()
        for url in (f"redis://127.0.0.1:{server.port}/0",
                    f"redis://:wrong@127.0.0.1:{server.port}/0"):
            with pytest.raises(redis.exceptions.AuthenticationError):
                redis.Redis.from_url(url).get("x")
        child = psutil.Process(server.process.pid)
        assert server.password not in " ".join(child.cmdline())
        listening = {c.laddr.ip for c in child.net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}


def test_the_child_is_killed_when_the_thread_that_started_it_ends():
    server = RedisServer()
    started = threading.Thread(target=server.start)
    started.start()
    started.join()
    try:
        assert psutil.Process(server.process.pid).name() == "redis-server"  # exec'd, not a wrapper
        deadline = time.monotonic() + 10
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.process.returncode == -9  # SIGKILL from the parent-death signal
    finally:
        server.stop()


def test_a_given_password_and_redaction():
    with RedisServer(password="given-pass") as server:
        assert redis.Redis.from_url(server.url).ping()
        assert redact_url(server.url) == f"redis://:***@127.0.0.1:{server.port}/0"
    assert redact_url("redis://10.0.0.1:6379/0") == "redis://10.0.0.1:6379/0"
    assert redact_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    with pytest.raises(ValueError, match="password"):
        RedisServer(password="has space")


def test_every_kind_of_url_secret_is_redacted_and_set_apart():
    assert redact_url("rediss://u:p%40ss@h:1/0?db=2") == "rediss://u:***@h:1/0?db=2"
    assert redact_url("redis://h:1/0?password=pw&db=2") == "redis://h:1/0?password=***&db=2"
    assert redact_url("ray://h:10001?token=tk") == "ray://h:10001?token=***"
    assert redact_url("redis://:pw@[::1:1/0") == "<URL hidden: it does not parse>"
    assert redact_url(None) is None
    assert url_password("redis://:p%40ss@h:1/0") == "p@ss"
    assert url_password("redis://h:1/0?password=pw") == "pw"
    assert url_password("redis://h:1/0") is None
    url = with_password("redis://h:1/0", "p@ss/w")
    assert url_password(url) == "p@ss/w" and redact_url(url) == "redis://:***@h:1/0"
    assert redis.connection.parse_url(url)["password"] == "p@ss/w"  # what redis-py reads
    with pytest.raises(ValueError, match="holds a password already"):
        with_password(url, "other")
