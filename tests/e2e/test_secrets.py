"""No secret in any log or process listing.

``pdserve --log-level DEBUG serve`` runs as a real subprocess (its own local Ray) with an API
key, an admin key, a priority key and a Redis password, each from a file or the environment,
on a redis-server of this test's own that logs verbosely to a file. Requests and admin calls go
through the real clients, refused ones included (wrong key, an inference key on Admin, a
priority it may not ask, a pool target of 10**6). Then every command line of the cluster's
processes and every log this test can reach is searched for each secret: the CLI's stdout and
stderr, the clients' output, every file under the Ray session's folder (read before the stop,
which removes it) and the Redis log.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import grpc
import psutil
import pytest

from pdserve.api.admin_client import AdminClient
from pdserve.api.client import PdserveError
from pdserve.cluster.redis_server import find_redis_server, free_port
from pdserve.testing.waits import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster, pytest.mark.slow]

CLI = [sys.executable, "-m", "pdserve.cli.main"]
START_S = 240.0  # bound on the cluster coming up on a loaded two-core machine


def _secret_file(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def _start_redis(password: str, log: Path) -> tuple[subprocess.Popen, int]:
    """A password-protected redis-server logging verbosely to ``log``; its config (and the
    password) on its stdin, as the embedded one gets it."""
    import redis

    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "-"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    proc.stdin.write(f"port {port}\nbind 127.0.0.1\nrequirepass {password}\nsave \"\"\n"
                     f"appendonly no\nloglevel verbose\nlogfile {log}\n".encode())
    proc.stdin.close()
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    wait_for(lambda: proc.poll() is None and client.ping(), 20, "the test's redis-server")
    client.close()
    return proc, port


def _wait_serving(log: Path, proc: subprocess.Popen) -> re.Match:
    pattern = r"gRPC on [^\s]+:(\d+), OpenAI HTTP on (\S+)/v1, metrics on (\S+),"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(pattern, log.read_text(errors="replace"))
        if match:
            return match
        time.sleep(0.5)
    raise AssertionError(f"pdserve serve did not serve:\n{log.read_text()[-4000:]}")


def _pdserve(*argv: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120, env=env)


def _http(url: str, key: str | None, body: dict | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _traffic(target: str, http: str, metrics: str, keys: dict, files: dict, env: dict) -> list:
    """Requests and admin calls, allowed and refused; returns every client's output."""
    outputs = []
    inference = {**env, "PDSERVE_API_KEY": keys["api"]}
    run = _pdserve("generate", "--target", target, "hello", "--max-tokens", "4", env=inference)
    assert run.returncode == 0, run.stderr
    refused = _pdserve("generate", "--target", target, "hi", "--priority", "-1", env=inference)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr
    ahead = _pdserve("generate", "--target", target, "hi", "--priority", "-1", "--max-tokens",
                     "2", "--api-key-file", files["priority"], env=env)
    assert ahead.returncode == 0, ahead.stderr
    wrong = _pdserve("generate", "--target", target, "hi", env={**env, "PDSERVE_API_KEY": "x"})
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr
    status = _pdserve("status", "--target", target, "--json", env={
        **env, "PDSERVE_ADMIN_API_KEY": keys["admin"]})
    assert status.returncode == 0 and json.loads(status.stdout)["pools"], status.stderr
    not_admin = _pdserve("status", "--target", target, "--admin-api-key-file", files["api"],
                         env=env)
    assert not_admin.returncode == 2 and "inference key cannot call Admin" in not_admin.stderr
    outputs += [run, refused, ahead, wrong, status, not_admin]
    with AdminClient(target, timeout=30, api_key=keys["admin"]) as admin:
        with pytest.raises(PdserveError) as err:
            admin.set_pool_target("decode", 10**6)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details.startswith("size must be in [0, 64]")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
    models = json.loads(_http(f"{http}/v1/models", keys["api"])[1])
    body["model"] = models["data"][0]["id"]
    assert _http(f"{http}/v1/completions", keys["api"], body)[0] == 200
    assert _http(f"{http}/v1/completions", keys["admin"], body)[0] == 401
    assert _http(f"{http}/v1/completions", keys["api"], {**body, "priority": -2})[0] == 403
    assert _http(metrics, None)[0] == 401
    status_code, text = _http(metrics, keys["admin"])
    assert status_code == 200 and "pdserve_time_to_first_token_seconds" in text
    return outputs


def _session_folders(processes: list[psutil.Process]) -> set[Path]:
    """The local Ray's temp folders, read from its processes' command lines."""
    folders = set()
    for proc in processes:
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        folders |= {Path(m) for m in re.findall(r"(/tmp/pdray-[^/\s]+)", line)}
    return folders


def _leaks(text: str, keys: dict) -> list[str]:
    forms = {name: {key, quote(key, safe="")} for name, key in keys.items()}
    return [name for name, found in forms.items() if any(f in text for f in found)]


def _read_all(folder: Path) -> dict[str, str]:
    out = {}
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                out[str(path)] = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue  # a socket, or a file gone since it was listed
    return out


def test_no_secret_reaches_a_log_or_a_command_line(tiny_dir, tmp_path):
    keys = {name: f"{name}-{secrets.token_hex(16)}" for name in ("api", "admin", "priority",
                                                                  "redis")}
    files = {name: _secret_file(tmp_path, name, key) for name, key in keys.items()}
    redis_log = tmp_path / "redis.log"
    redis_proc, redis_port = _start_redis(keys["redis"], redis_log)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_ADDRESS", "PDSERVE_"))}
    out_log, err_log = tmp_path / "serve.out", tmp_path / "serve.err"
    with open(out_log, "w") as out, open(err_log, "w") as err:
        serve = subprocess.Popen(
            [*CLI, "--log-level", "DEBUG", "serve", "--model", str(tiny_dir), "--port", "0",
             "--http-port", "0", "--metrics-port", "0", "--memory-budget-mib", "256",
             "--api-key-file", files["api"], "--admin-api-key-file", files["admin"],
             "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
             "--redis-password-file", files["redis"]],
            stdout=out, stderr=err, env={**env, "PDSERVE_PRIORITY_API_KEYS": keys["priority"]},
            start_new_session=True)
    logs: dict[str, str] = {}
    try:
        match = _wait_serving(err_log, serve)
        target = f"127.0.0.1:{match.group(1)}"
        outputs = _traffic(target, match.group(2), match.group(3), keys, files, env)
        logs.update({f"client {' '.join(o.args[3:5])}": o.stdout + o.stderr for o in outputs})
        tree = [psutil.Process(serve.pid), *psutil.Process(serve.pid).children(recursive=True),
                psutil.Process(redis_proc.pid)]
        for proc in tree:
            line = " ".join(proc.cmdline())
            assert not _leaks(line, keys), (proc.pid, _leaks(line, keys))
        folders = _session_folders(tree)
        assert folders, "no Ray session folder found on the command lines"
        for folder in folders:
            logs.update(_read_all(folder))
        assert any("/logs/" in name for name in logs), sorted(logs)[:20]
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait(10)
        redis_proc.terminate()
        redis_proc.wait(10)
    assert serve.returncode == 0
    logs["pdserve serve stdout"] = out_log.read_text(errors="replace")
    logs["pdserve serve stderr"] = err_log.read_text(errors="replace")
    logs["redis log"] = redis_log.read_text(errors="replace")
    assert "Redis redis://:***@127.0.0.1:" in logs["pdserve serve stderr"]
    assert "DEBUG" in logs["pdserve serve stderr"] and "Accepted" in logs["redis log"]
    leaked = {name: _leaks(text, keys) for name, text in logs.items() if _leaks(text, keys)}
    assert leaked == {}, leaked
