"""The LoRA settings of ``pdserve serve`` (the engine's flags reach every pool;
``--lora-modules`` in vLLM's forms; every bad value exits 2 with one line naming the flag and
the adapter, before anything starts) and ``pdserve lora load|unload|list`` against a real gRPC
server with an in-memory Admin backend."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from pdserve.cli import settings
from pdserve.cli.main import build_parser, main
from pdserve.cluster.options import ClusterOptions
from pdserve.router.adapters import ServedAdapters
from pdserve.router.grpc_server import GenerationServer
from pdserve.testing.fake_admin import FakeAdmin
from pdserve.testing.fake_backend import FakeBackend
from pdserve.testing.lora_adapters import write_peft_adapter
from pdserve.worker_api.adapters import AdapterRef


@pytest.fixture(scope="module")
def rank8(tiny_dir, tmp_path_factory):
    return write_peft_adapter(tiny_dir, tmp_path_factory.mktemp("lora") / "r8", 8,
                              ("q_proj", "down_proj"), seed=4)


def _options(*argv: str) -> ClusterOptions:
    return settings.options_from_args(build_parser().parse_args(["serve", *argv]),
                                      ClusterOptions())


def _run_cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    return exc.value.code, capsys.readouterr().err


def test_lora_flags_reach_every_pool(tiny_dir):
    from pdserve.cluster.launcher import EmbeddedCluster

    options = _options("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                       "--max-cpu-loras", "3", "--lora-modules", "a=/x",
                       '{"name": "b", "path": "/y"}')
    assert options.lora_modules == ("a=/x", '{"name": "b", "path": "/y"}')
    cluster = EmbeddedCluster(options)
    cluster.model, cluster.redis_url = str(tiny_dir), "redis://127.0.0.1:1"
    configs = [spec.config for spec in cluster.worker_specs()]
    assert {(c.enable_lora, c.max_loras, c.max_lora_rank, c.max_cpu_loras)
            for c in configs} == {(True, 2, 8, 3)}
    spec = cluster._router_spec(0, {})
    assert (spec.enable_lora, spec.max_lora_rank) == (True, 8)
    assert spec.lora_modules == (("a", "/x"), ("b", "/y"))


@pytest.mark.parametrize(("argv", "says"), [
    (["--max-lora-rank", "0"], "argument --max-lora-rank: max_lora_rank"),
    (["--max-loras", "0"], "argument --max-loras: max_loras"),
    (["--lora-modules", "a=/x"], "lora_modules needs enable_lora"),
    (["--enable-lora", "--lora-modules", "a"], "argument --lora-modules: lora_modules entry 'a'"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names 'a' more than once"),
    (["--enable-lora", "--lora-modules", "{oops"], "is not JSON"),
    (["--enable-lora", "--lora-modules", "gone=/no/such/folder"],
     "argument --lora-modules: LoRA adapter 'gone': /no/such/folder is not a folder"),
])
def test_bad_lora_settings_exit_2_with_one_line(capsys, no_cluster, tiny_dir, argv, says):
    code, err = _run_cli(capsys, "serve", "--model", str(tiny_dir), *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("pdserve serve: error: ") and says in lines[0], lines[0]


def test_an_adapter_above_the_rank_limit_is_refused_before_start(capsys, no_cluster, tiny_dir,
                                                                 rank8):
    code, err = _run_cli(capsys, "serve", "--model", str(tiny_dir), "--enable-lora",
                         "--max-lora-rank", "4", "--lora-modules", f"big={rank8}")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "argument --lora-modules: LoRA adapter 'big'" in err and "above max_lora_rank" in err


@pytest.fixture
def server():
    """(target, FakeAdmin) served from a background event loop."""
    admin = FakeAdmin([], {}, ServedAdapters([AdapterRef("sql", "/adapters/sql", "c" * 64)]))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    grpc_server = GenerationServer(FakeBackend(), admin=admin)
    port = asyncio.run_coroutine_threadsafe(grpc_server.start("127.0.0.1", 0), loop).result(10)
    yield f"127.0.0.1:{port}", admin
    asyncio.run_coroutine_threadsafe(grpc_server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_lora_commands(server, capsys):
    target, admin = server
    assert main(["lora", "load", "chat", "/adapters/chat", "--target", target]) == 0
    assert "LoRA adapter 'chat' loaded from /adapters/chat" in capsys.readouterr().err
    assert main(["lora", "list", "--json", "--target", target]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in listed] == ["chat", "sql"]
    assert listed[1] == {"name": "sql", "path": "/adapters/sql", "digest": "c" * 64}
    assert main(["lora", "unload", "chat", "--target", target]) == 0
    assert admin.adapters.get("chat") is None
    assert main(["lora", "list", "--target", target]) == 0
    assert "sql" in capsys.readouterr().out
    for argv, says in ((["unload", "chat"], "'chat' is not loaded"),
                       (["load", "sql", "/adapters/x"], "'sql' is already loaded"),
                       (["load", "x", "/tmp/x"], "not a folder")):
        code, err = _run_cli(capsys, "lora", *argv, "--target", target)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
