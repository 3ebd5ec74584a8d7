"""The one way pdserve opens a listening TCP socket: on exactly the configured host, never
every interface (the HTTP front door and the KV transfer store both take it)."""

from __future__ import annotations

import socket


def listening_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on exactly ``host`` (IPv4 or IPv6 literal or a name); port 0
    takes a free one. Its connections send at once (``TCP_NODELAY``): a streamed answer is
    many small writes, and with Nagle's algorithm each waits for the client's ACK of the one
    before, which Linux delays by up to 40 ms. The socket is made with the TCP protocol number
    (asyncio sets ``TCP_NODELAY`` only on connections of such sockets) and carries the option
    itself (Linux copies it to every accepted connection)."""
    family, _type, proto, _name, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
