"""A streaming worker's hot calls, ``poll`` and ``submit``, over a socket of their own, beside
Ray.

A streaming worker's ``poll`` is the one call a router makes for every step that streams, and
``submit`` the one it makes for every request it places there. Through a Ray actor call each
round trip passes the caller's and the callee's event loops, Ray's IO threads and its task
bookkeeping, many times the time and CPU of a round trip on a plain socket, and that CPU is
spent on the cores the engine computes on (docs/cpu-speed.md has the figures). So a worker
actor serves those two calls on a socket too (:class:`ChannelServer`), and a router's handle
makes them through it (:class:`ChannelClient`) once the actor, over Ray, has told it where the
socket is and the key that opens it: every other call, and finding the worker, stays on Ray.

The framing and the handshake are ``multiprocessing.connection``'s: a connection must answer
an HMAC challenge on a random 32-byte key that only travels over Ray's own (authenticated)
channel, and prove it knows the key too; then it carries pickled objects, as Ray's own calls
do. A connection's thread serves its calls one at a time; a router opens one for its polls
(which block) and one for its submits. A call is ``(name, args)``, ``name`` one of the calls
the server was built with; an answer ``("ok", value)`` or ``("error", exception)``, the
exception the call raised, raised again in the router.

A router tells a dead worker from a slow one the way a Ray call did: the worker's process
ending closes the socket (EOF at once); a call not answered within the time it may take plus
``ANSWER_GRACE_S`` (the worker's host gone without closing it) fails too.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import threading
from collections.abc import Callable, Mapping
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Client,
    Connection,
    answer_challenge,
    deliver_challenge,
)

from pdserve.net import listening_socket
from pdserve.worker_api import StepDeltas, WorkRequest

logger = logging.getLogger(__name__)

ANSWER_GRACE_S = 30.0  # a call unanswered this long past what it may take: the worker is
# unreachable


class ChannelLost(ConnectionError):
    """The worker's end of the channel is gone (closed, or silent past the grace)."""


class ChannelServer:
    """Serves ``calls`` (name -> callable; ``poll(timeout, router) -> StepDeltas`` and
    ``submit(request, router) -> None`` for a streaming worker) on ``(host, any free port)``
    to clients that know :attr:`authkey`; a thread accepts, a thread per connection
    answers."""

    def __init__(self, calls: Mapping[str, Callable[..., object]], host: str):
        self.authkey = secrets.token_bytes(32)
        self._calls = dict(calls)
        # TCP_NODELAY (net.listening_socket): an answer over 16 KiB goes in two writes, and
        # Nagle's algorithm would hold the second until the router acknowledged the first
        self._socket = listening_socket(host, 0)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self._served: set[socket.socket] = set()  # the routers' connections
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="worker-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                accepted, _ = self._socket.accept()
            except OSError:  # close()
                return
            threading.Thread(target=self._serve, args=(accepted,), daemon=True,
                             name="worker-channel-calls").start()

    def _serve(self, accepted: socket.socket) -> None:
        """One connection's calls, after it answers the challenge (on this thread: a client
        that stalls there holds up no other)."""
        with self._lock:
            if self._closed:
                accepted.close()
                return
            self._served.add(accepted)
        connection = Connection(os.dup(accepted.fileno()))
        try:
            deliver_challenge(connection, self.authkey)
            answer_challenge(connection, self.authkey)
            while True:
                name, args = connection.recv()
                connection.send(self._answer(name, args))
        except AuthenticationError:
            logger.warning("worker channel: refused a connection that did not know the key")
        except (EOFError, OSError):  # the router went away, or close()
            pass
        finally:
            with self._lock:
                self._served.discard(accepted)
            connection.close()
            accepted.close()

    def _answer(self, name: str, args: tuple) -> tuple[str, object]:
        try:
            call = self._calls.get(name)
            if call is None:
                raise TypeError(f"the worker channel serves no call {name!r}")
            return "ok", call(*args)
        except Exception as exc:  # noqa: BLE001 - the router raises it again
            try:
                pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an exception pickle cannot carry
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            return "error", exc

    def close(self) -> None:
        """Stop accepting and end every connection (their routers see the channel lost)."""
        with self._lock:
            self._closed = True
            _shut(self._socket)
            for served in self._served:  # (their threads see EOF and close them)
                _shut(served, close=False)


def _shut(sock: socket.socket, close: bool = True) -> None:
    """Wake whatever thread blocks on ``sock`` (closing it alone does not)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected (any more)
        pass
    if close:
        sock.close()


class ChannelClient:
    """One connection of a router to a :class:`ChannelServer`; its calls block (make them off
    the event loop, one at a time)."""

    def __init__(self, address: tuple[str, int], authkey: bytes, router: str = "",
                 grace_s: float = ANSWER_GRACE_S):
        self._connection = Client((str(address[0]), int(address[1])), authkey=authkey)
        self._router = router
        self._grace_s = grace_s

    def poll(self, timeout: float) -> StepDeltas:
        """The router's deltas (waits up to ``timeout`` for some)."""
        return self._call("poll", (timeout, self._router), timeout)

    def submit(self, request: WorkRequest) -> None:
        """Queue ``request`` on the worker for this router (answered once the worker has checked
        and queued it, never after a step)."""
        self._call("submit", (request, self._router), 0.0)

    def _call(self, name: str, args: tuple, takes_s: float):
        """The call's value; ChannelLost when the worker's end is gone or silent for
        ``takes_s`` plus the grace; what the worker's call raised, raised here."""
        try:
            self._connection.send((name, args))
            answered = self._connection.poll(takes_s + self._grace_s)
            if answered:
                status, value = self._connection.recv()
        except (EOFError, OSError) as exc:
            raise ChannelLost(f"the worker channel closed: {exc!r}") from exc
        if not answered:
            raise ChannelLost(f"no answer to {name} within {takes_s + self._grace_s:g} s")
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        self._connection.close()
