"""Secrets never on the command line: ``--api-key KEY`` (serve and the client commands), its
admin, priority and Redis kin, and a password inside ``--redis-url`` exit 2 with one line naming
the file or environment form, the secret never echoed; the files and variables that replace
them (``credentials.resolve_secrets``, the client key files) read as documented; ``pdserve
status`` against a real gRPC server that wants its admin key."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.cli.main import main
from pdserve.cluster.credentials import SecretError, resolve_secrets
from pdserve.cluster.options import ClusterOptions
from pdserve.router.grpc_server import GenerationServer
from pdserve.testing.fake_admin import FakeAdmin
from pdserve.testing.fake_backend import FakeBackend

SECRET = "s3cret-value-42"
# A budget too small for any model: should the check under test let a command line through,
# the memory check after it stops it with another line, instead of a cluster starting.
THEN_STOP = ["--memory-budget-mib", "1"]


def _one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert SECRET not in err[0]
    return err[0]


@pytest.mark.parametrize("argv, instead", [
    (["serve", "--api-key", SECRET], "--api-key-file FILE, or set PDSERVE_API_KEY"),
    (["serve", f"--api-key={SECRET}", "--port", "0"], "--api-key-file"),
    (["demo", "--api-key", SECRET], "PDSERVE_API_KEY"),
    (["serve", "--admin-api-key", SECRET], "--admin-api-key-file FILE, or set "
                                           "PDSERVE_ADMIN_API_KEY"),
    (["serve", "--priority-api-key", SECRET], "PDSERVE_PRIORITY_API_KEYS"),
    (["serve", "--redis-password", SECRET], "--redis-password-file FILE"),
    (["generate", "--api-key", SECRET, "hello"], "--api-key-file"),
    (["status", "--api-key", SECRET], "--api-key-file"),
    (["status", "--admin-api-key", SECRET], "--admin-api-key-file"),
    (["drain", "decode-0", "--api-key", SECRET], "--api-key-file"),
    (["bench", "serve", "--api-key", SECRET], "--api-key-file"),
])
def test_a_secret_flag_exits_2_saying_what_to_use(argv, instead, capsys):
    line = _one_line_error(argv, capsys)
    assert "a secret on the command line shows in ps" in line and instead in line, line
    assert line.startswith("pdserve ") and ": error: argument --" in line


def test_a_password_in_redis_url_exits_2_before_anything_starts(capsys):
    line = _one_line_error(["serve", "--redis-url", f"redis://:{SECRET}@127.0.0.1:1/0",
                            "--port", "0", *THEN_STOP], capsys)
    assert line.startswith("pdserve serve: error: argument --redis-url: the URL holds a "
                           "password"), line
    assert "--redis-password-file" in line and "PDSERVE_REDIS_URL" in line


def test_unreadable_key_files_exit_2_naming_the_flag(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    for flag in ("--api-key-file", "--admin-api-key-file", "--priority-api-key-file",
                 "--redis-password-file"):
        line = _one_line_error(["serve", flag, missing, "--port", "0", *THEN_STOP], capsys)
        assert line.startswith(f"pdserve serve: error: argument {flag}: cannot read {missing}")
    line = _one_line_error(["status", "--admin-api-key-file", missing], capsys)
    assert line.startswith(f"pdserve status: error: argument --admin-api-key-file: cannot "
                           f"read {missing}")


def _file(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_files_then_environment_fill_the_secrets(tmp_path):
    files = ClusterOptions(api_key_file=_file(tmp_path, "api", "file-key\n"),
                           admin_api_key_file=_file(tmp_path, "admin", "# ops\nadmin-key\n"),
                           priority_api_key_file=_file(tmp_path, "prio", "p1\np2\n"),
                           redis_password_file=_file(tmp_path, "redis", "pw/1@x\n"),
                           redis_url="redis://127.0.0.1:6390/0")
    env = {"PDSERVE_API_KEY": "env-key", "PDSERVE_ADMIN_API_KEY": "env-admin",
           "PDSERVE_PRIORITY_API_KEYS": "e1, e2", "PDSERVE_REDIS_PASSWORD": "env-pw"}
    got = resolve_secrets(files, env)  # a flag wins over its variable
    assert (got.api_key, got.admin_api_key, got.priority_api_keys) == \
        ("file-key", "admin-key", ("p1", "p2"))
    assert got.redis_url == "redis://:pw%2F1%40x@127.0.0.1:6390/0"
    assert got.redis_password == "pw/1@x"
    for secret in ("file-key", "admin-key", "'p1'", "pw/1@x", "pw%2F1%40x"):
        assert secret not in repr(got)  # never in a log line that shows the options
    got = resolve_secrets(ClusterOptions(), {**env, "PDSERVE_REDIS_URL": "redis://h:1/0"})
    assert (got.api_key, got.admin_api_key, got.priority_api_keys) == \
        ("env-key", "env-admin", ("e1", "e2"))
    assert got.redis_url == "redis://:env-pw@h:1/0"
    embedded = resolve_secrets(ClusterOptions(), {"PDSERVE_REDIS_PASSWORD": "env-pw"})
    assert embedded.redis_url is None and embedded.redis_password == "env-pw"


@pytest.mark.parametrize("options, env, message", [
    (dict(api_key_file="two"), {}, "holds 2 keys; one expected"),
    (dict(admin_api_key_file="api"), {"PDSERVE_API_KEY": "same"}, "admin_api_key must differ"),
    (dict(), {"PDSERVE_REDIS_URL": "redis://:a@h:1/0", "PDSERVE_REDIS_PASSWORD": "b"},
     "keep one of them"),
])
def test_conflicting_or_malformed_secrets_are_refused(tmp_path, options, env, message):
    _file(tmp_path, "two", "k1\nk2\n")
    _file(tmp_path, "api", "same\n")
    options = {k: str(tmp_path / v) for k, v in options.items()}
    with pytest.raises(SecretError, match=message) as err:
        resolve_secrets(ClusterOptions(**options), env)
    assert "k1" not in str(err.value) and "same" not in str(err.value)


@pytest.fixture
def keyed_server():
    """A gRPC server whose Admin wants ADMIN and whose Generation wants "api-key"."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = GenerationServer(FakeBackend(), admin=FakeAdmin([], {"decode": 1}),
                              api_key="api-key", admin_api_key="admin-key")
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(10)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_status_sends_the_admin_key_from_its_file_or_the_environment(keyed_server, tmp_path,
                                                                      capsys, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "api-key")  # an inference key is no admin key
    monkeypatch.delenv("PDSERVE_ADMIN_API_KEY", raising=False)
    line = _one_line_error(["status", "--target", keyed_server, "--json"], capsys)
    assert "wants its admin key: pass --admin-api-key-file" in line
    inference = _file(tmp_path, "inference", "api-key\n")
    line = _one_line_error(["status", "--target", keyed_server, "--admin-api-key-file",
                            inference], capsys)
    assert "refused: an inference key cannot call Admin" in line
    admin = _file(tmp_path, "admin", "admin-key\n")
    assert main(["status", "--target", keyed_server, "--json",
                 "--admin-api-key-file", admin]) == 0
    assert '"decode"' in capsys.readouterr().out
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", "admin-key")
    assert main(["status", "--target", keyed_server, "--json"]) == 0


def test_the_clients_docs_name_only_key_flags_serve_accepts():
    """The Python clients' docs tell a user how a server gets its key: a flag serve takes
    (``--api-key-file``), never the ``--api-key KEY`` it refuses."""
    import re
    from pathlib import Path

    import pdserve.api

    refused = re.compile(r"--(admin-|priority-)?api-key\b(?!-file)")
    for path in sorted(Path(pdserve.api.__file__).parent.glob("*client*.py")):
        hits = [line for line in path.read_text().splitlines() if refused.search(line)]
        assert not hits, (path.name, hits)
