"""``net.listening_socket``: bound to exactly the host asked, and every connection it accepts
sends at once (TCP_NODELAY), whether asyncio (uvicorn's loop) or a plain ``accept`` takes it."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve import net


def _nodelay(sock) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


HOSTS = ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(
    not _ipv6_loopback(), reason="no IPv6 loopback here"))]


@pytest.mark.parametrize("host", HOSTS)
def test_the_socket_is_tcp_on_exactly_the_host_and_sends_at_once(host):
    with net.listening_socket(host, 0) as sock:
        assert sock.getsockname()[0] == host
        assert sock.proto == socket.IPPROTO_TCP
        assert _nodelay(sock)


@pytest.mark.parametrize("host", HOSTS)
def test_a_plainly_accepted_connection_sends_at_once(host):
    with net.listening_socket(host, 0) as sock:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            accepted, _ = sock.accept()
            with accepted:
                assert _nodelay(accepted)


def test_a_connection_asyncio_accepts_sends_at_once():
    async def accept_one() -> int:
        sock = net.listening_socket("127.0.0.1", 0)
        sock.setblocking(False)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def handle(_reader, writer):
            seen.set_result(_nodelay(writer.get_extra_info("socket")))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 5)
            await reader.read()
            writer.close()
        return value

    assert asyncio.run(accept_one())
