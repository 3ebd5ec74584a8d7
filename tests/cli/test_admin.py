"""``pdserve status`` and ``pdserve drain`` against a real gRPC server with an in-memory
Admin backend (the e2e tests run them against a real cluster)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import pytest

from pdserve.cli.main import main
from pdserve.router.admin_server import WorkerInfo
from pdserve.router.grpc_server import GenerationServer
from pdserve.testing.fake_admin import FakeAdmin
from pdserve.testing.fake_backend import FakeBackend

WORKER_KEYS = {"worker_id", "role", "node", "pid", "state", "running", "waiting",
               "kv_used_blocks", "kv_total_blocks", "heartbeat_age_s", "restarts",
               "compute_utilization", "bandwidth_utilization", "busy_fraction", "binding",
               "device", "torch_threads", "tensor_parallel_size", "kv_int8", "lora_slots",
               "lora_resident", "kv_host_blocks", "kv_disk_blocks"}


@pytest.fixture
def server():
    """(target, FakeAdmin) served from a background event loop."""
    admin = FakeAdmin([
        WorkerInfo("prefill-0", "prefill", "ready", "127.0.0.1", 101, 1, 2, 3, 64, 0.25),
        WorkerInfo("decode-0", "decode", "ready", "127.0.0.1", 102, 4, 0, 10, 128, 0.5,
                   compute_utilization=0.05, bandwidth_utilization=0.4, busy_fraction=0.9,
                   binding="bandwidth", ledger=dict(budget_bytes=512 << 20,
                                                    weight_bytes=64 << 20,
                                                    activation_bytes=32 << 20,
                                                    kv_pool_bytes=390 << 20,
                                                    margin_bytes=26 << 20, num_kv_blocks=780,
                                                    block_size=16, device="cpu",
                                                    num_threads=2,
                                                    kv_int8="hybrid calibrated on text")),
        WorkerInfo("decode-2", "decode", "starting", restarts=1),
        WorkerInfo("decode-1", "decode", "dead", "127.0.0.1", 103, error="actor died"),
    ], {"prefill": 1, "decode": 2})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    grpc_server = GenerationServer(FakeBackend(), admin=admin)
    port = asyncio.run_coroutine_threadsafe(grpc_server.start("127.0.0.1", 0), loop).result(10)
    yield f"127.0.0.1:{port}", admin
    asyncio.run_coroutine_threadsafe(grpc_server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


def test_status_json_is_one_object_with_pools_and_workers(server, capsys):
    target, _admin = server
    assert main(["status", "--target", target, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # exactly one JSON document
    assert set(report) == {"pools", "workers", "control_plane"}
    assert report["control_plane"] == {"degraded": False, "degraded_for_s": 0.0, "error": "",
                                       "malformed_records": 0, "repairs": 0}
    assert report["pools"]["decode"]["target"] == 2 and report["pools"]["decode"]["actual"] == 2
    assert report["pools"]["prefill"] == {"target": 1, "actual": 1, "ready": 1, "starting": 0,
                                          "draining": 0, "restarts": 0, "last_error": ""}
    assert all(set(w) == WORKER_KEYS for w in report["workers"])
    by_id = {w["worker_id"]: w for w in report["workers"]}
    assert by_id["decode-0"] == {"worker_id": "decode-0", "role": "decode", "node": "127.0.0.1",
                                 "pid": 102, "state": "ready", "running": 4, "waiting": 0,
                                 "kv_used_blocks": 10, "kv_total_blocks": 128,
                                 "heartbeat_age_s": 0.5, "restarts": 0,
                                 "compute_utilization": 0.05, "bandwidth_utilization": 0.4,
                                 "busy_fraction": 0.9, "binding": "bandwidth", "device": "cpu",
                                 "torch_threads": 2, "tensor_parallel_size": 1,
                                 "kv_int8": "hybrid calibrated on text", "lora_slots": 0,
                                 "lora_resident": [], "kv_host_blocks": 0,
                                 "kv_disk_blocks": 0}
    assert by_id["decode-2"]["state"] == "starting"
    assert by_id["decode-2"]["heartbeat_age_s"] is None
    assert by_id["decode-1"]["state"] == "dead"


def test_status_table_lists_pools_and_workers(server, capsys):
    target, _admin = server
    assert main(["status", "--target", target]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["POOL", "TARGET", "ACTUAL", "READY", "STARTING", "DRAINING",
                                "RESTARTS"]
    assert lines[1].split() == ["decode", "2", "2", "1", "1", "0", "1"]
    row = next(line for line in lines if line.startswith("decode-0"))
    assert row.split() == ["decode-0", "decode", "ready", "127.0.0.1", "102", "cpu", "x2", "4",
                           "0",
                           "10/128", "5.0%", "40.0%", "bandwidth", "0.5s", "0"]
    assert "actor died" in next(line for line in lines if line.startswith("decode-1"))
    assert "decode-0: int8 KV hybrid calibrated on text" in lines  # what the ledger says


def test_status_shows_a_lora_column_when_a_worker_serves_adapters(server, capsys):
    target, admin = server
    admin.workers["decode-0"] = dataclasses.replace(admin.workers["decode-0"], lora_slots=4,
                                                    lora_resident=("a" * 64, "b" * 64))
    assert main(["status", "--target", target]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("WORKER")).split()
    assert header[header.index("BLOCKS") + 1] == "LORA"  # (after "KV BLOCKS")
    row = next(line for line in lines if line.startswith("decode-0")).split()
    assert row[row.index("10/128") + 1] == "2/4"
    prefill = next(line for line in lines if line.startswith("prefill-0")).split()
    assert prefill[prefill.index("3/64") + 1] == "-"  # serves no adapters
    assert main(["status", "--target", target, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [decode] = [w for w in report["workers"] if w["worker_id"] == "decode-0"]
    assert (decode["lora_slots"], decode["lora_resident"]) == (4, ["a" * 64, "b" * 64])


def test_status_shows_a_kv_tiers_column_when_a_worker_holds_blocks_below_its_pool(server,
                                                                                  capsys):
    target, admin = server
    assert main(["status", "--target", target]) == 0
    assert "KV TIERS" not in capsys.readouterr().out  # no worker holds any: no column
    admin.workers["decode-0"] = dataclasses.replace(admin.workers["decode-0"],
                                                    kv_host_blocks=120, kv_disk_blocks=900)
    assert main(["status", "--target", target]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("WORKER"))
    row = next(line for line in lines if line.startswith("decode-0"))
    start = header.index("KV TIERS")
    assert row[start:].startswith("h 120 / d 900")
    prefill = next(line for line in lines if line.startswith("prefill-0"))
    assert prefill[start:].split()[0] == "-"
    assert main(["status", "--target", target, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [decode] = [w for w in report["workers"] if w["worker_id"] == "decode-0"]
    assert (decode["kv_host_blocks"], decode["kv_disk_blocks"]) == (120, 900)


def test_status_says_when_the_control_plane_is_degraded(server, capsys):
    from pdserve.router.admin_server import ControlPlaneInfo

    target, admin = server
    assert main(["status", "--target", target]) == 0
    assert "control plane: ok, Redis reachable" in capsys.readouterr().out
    admin.plane = ControlPlaneInfo(True, 12.25, "Error 111 connecting", 3, 7)
    assert main(["status", "--target", target]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("control"))
    assert line.startswith("control plane: DEGRADED for 12.2 s, Redis unreachable (Error 111 "
                           "connecting): serving with the workers the router knows")
    assert "3 malformed records skipped, 7 values re-published" in line


def test_status_checklist_prints_utilisation_and_memory(server, capsys):
    target, _admin = server
    assert main(["status", "--target", target, "--checklist"]) == 0
    out = capsys.readouterr().out
    assert "this server keeps no request traces" in out  # the fake backend keeps none
    util = next(line for line in out.splitlines() if line.split()[:2] == ["decode", "1"])
    assert util.split()[2:] == ["5.0%", "40.0%", "90%", "bandwidth"]
    memory = next(line for line in out.splitlines()
                  if line.startswith("decode-0") and "MiB" not in line and "(" in line)
    assert "64 (12%)" in memory and "390 (76%)" in memory and "780 x 16" in memory


def test_drain_marks_the_worker_and_lowers_its_target(server, capsys):
    target, admin = server
    assert main(["drain", "--target", target, "decode-0"]) == 0
    assert admin.drained == ["decode-0"] and admin.targets["decode"] == 1
    assert "decode pool target now 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["drain", "decode-9"], "unknown worker 'decode-9'"),
    (["drain", "decode-1"], "is dead"),
    (["status", "--target", "localhost"], "expected HOST:PORT"),
])
def test_user_errors_exit_2_with_one_line(server, capsys, argv, message):
    target, _admin = server
    if "--target" not in argv:
        argv = [*argv, "--target", target]
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_unreachable_server_exits_2(capsys):
    assert _exit_code(["status", "--target", "127.0.0.1:1", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach a pdserve router at 127.0.0.1:1" in err and "Traceback" not in err
