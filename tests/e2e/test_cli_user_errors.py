"""Every user error ends ``pdserve`` with exit 2 and one line naming the flag that fixes it.

A user error a worker finds itself (here: a budget too small, on a joined Ray cluster where
the CLI cannot check it first) crosses Ray to become that line. Everything the CLI can check
itself is checked before it starts Ray or Redis (the real command in a subprocess, whose
stderr must be that one line): the log level, busy ports (gRPC, HTTP, metrics, the default
metrics port 9400 included), a host that does not resolve, unreadable key, TLS and config
files.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from pdserve.cli.main import main

pytestmark = pytest.mark.e2e


def test_worker_budget_error_crosses_ray_and_exits_2(ray_session, redis_url, tiny_dir, capsys,
                                                     monkeypatch):
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setenv("PDSERVE_REDIS_URL", redis_url)  # it holds the password: never argv
    try:
        with pytest.raises(SystemExit) as exc:  # --ray-address: joins the session's Ray
            main(["serve", "--model", str(tiny_dir), "--ray-address", "session", "--port", "0",
                  "--metrics-port", "none", "--memory-budget-mib", "1",
                  "--colocated"])  # one worker actor to fail is enough
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("pdserve serve: error: the memory budget (1.0 MiB) is too small"), last
    assert "--memory-budget-mib to at least" in last and "--num-kv-blocks" in last
    assert ray_session.is_initialized()  # a joined cluster is left running


# -- bad command lines, as a user types them: a subprocess, checked before Ray or Redis starts --
CLI = [sys.executable, "-m", "pdserve.cli.main"]
# A budget too small for any model: should the check under test let a command line through,
# the memory check after it stops it with another line, instead of a cluster starting.
THEN_STOP = ("--memory-budget-mib", "1")


def _run(*argv: str, env: dict | None = None) -> str:
    """Run ``pdserve ARGV``; assert exit 2 with exactly one line on stderr (no Ray or Redis
    output, no traceback); return it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS",
                                                                          "PDSERVE_"))}
    result = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=180,
                            env={**environ, **(env or {})})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr)
    assert "Traceback" not in lines[0] and result.stdout == ""
    return lines[0]


def _run_here(capsys, *argv: str) -> str:
    """``_run`` in this process (no interpreter to start: the cases below differ only in the
    flag they break; the subprocess cases above show the real command's behaviour)."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1, (exc.value.code, lines)
    return lines[0]


@pytest.fixture
def listening():
    """``listening(port)``: a socket listening on 127.0.0.1:``port`` (0: a free one) until the
    test ends; returns the port, or the port as it stands when another process holds it."""
    sockets = []

    def listen(port: int = 0) -> int:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:  # held already (by another server): busy all the same
            sock.close()
            return port
        sockets.append(sock)
        return sock.getsockname()[1]

    yield listen
    for sock in sockets:
        sock.close()


def test_a_bad_log_level_exits_2_naming_the_flag():
    line = _run("--log-level", "nope", "serve")
    assert line.startswith("pdserve: error: argument --log-level: invalid choice: 'nope'"), line
    assert "DEBUG, INFO, WARNING, ERROR, CRITICAL" in line


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_busy_port_exits_2_naming_its_flag(flag, listening, tiny_dir, capsys):
    ports = {"--port": "0", "--http-port": "0", "--metrics-port": "0", flag: str(listening())}
    line = _run_here(capsys, "serve", "--model", str(tiny_dir),
                     *[w for p in ports.items() for w in p], *THEN_STOP)
    assert line.startswith(f"pdserve serve: error: argument {flag}: port {ports[flag]} on "
                           f"127.0.0.1 is in use by another process"), line
    assert f"{flag} 0: any free port" in line


def test_the_default_metrics_port_busy_exits_2(listening, tiny_dir):
    listening(9400)  # the default --metrics-port
    line = _run("serve", "--model", str(tiny_dir), "--port", "0", *THEN_STOP)
    assert line.startswith("pdserve serve: error: argument --metrics-port: port 9400 on "
                           "127.0.0.1 is in use"), line
    assert "none: no metrics" in line


def test_a_host_that_does_not_resolve_exits_2(tiny_dir):
    line = _run("serve", "--model", str(tiny_dir), "--host", "no-such-host.invalid",
                "--port", "0", "--metrics-port", "0", *THEN_STOP)
    assert line.startswith("pdserve serve: error: argument --host: 'no-such-host.invalid' "
                           "does not resolve"), line


@pytest.mark.parametrize("flags, named", [
    (["--api-key-file", "{missing}"], "argument --api-key-file: cannot read {missing}"),
    (["--admin-api-key-file", "{missing}"],
     "argument --admin-api-key-file: cannot read {missing}"),
    (["--priority-api-key-file", "{missing}"],
     "argument --priority-api-key-file: cannot read {missing}"),
    (["--redis-password-file", "{missing}"],
     "argument --redis-password-file: cannot read {missing}"),
    (["--tls-cert", "{missing}", "--tls-key", "{missing}"],
     "argument --tls-cert: tls_cert: cannot read {missing}"),
    (["--autoscale-config", "{missing}"], "argument --autoscale-config:"),
])
def test_an_unreadable_file_exits_2_naming_its_flag(flags, named, tiny_dir, tmp_path, capsys,
                                                    monkeypatch):
    for name in [k for k in os.environ if k.startswith(("RAY_ADDRESS", "PDSERVE_"))]:
        monkeypatch.delenv(name)
    missing = str(tmp_path / "missing")
    line = _run_here(capsys, "serve", "--model", str(tiny_dir), "--port", "0",
                     "--metrics-port", "0", *[f.format(missing=missing) for f in flags],
                     *THEN_STOP)
    assert line.startswith(f"pdserve serve: error: {named.format(missing=missing)}"), line
