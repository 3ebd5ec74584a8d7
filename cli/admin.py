"""The operator commands of ``pdserve``: ``status``, ``drain`` and ``lora`` (``load NAME
PATH``, ``unload NAME``, ``list``: the cluster's LoRA adapters), clients of a running router's
``pdserve.v1.Admin`` service."""

from __future__ import annotations

import json
import sys
import time

import grpc

from pdserve.api.admin_client import AdminClient, control_plane_dict, pool_dict, worker_dict
from pdserve.api.client import PdserveError
from pdserve.cli.checklist import format_checklist
from pdserve.cli.common import add_client_security, admin_security, fail


def add_status(sub) -> None:
    status = sub.add_parser("status", help="pools (target and actual size) and workers of a "
                                           "running server")
    status.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    status.add_argument("--json", action="store_true",
                        help='print one JSON object: {"pools": {role: {...}}, "workers": [...]}')
    status.add_argument("--checklist", type=int, nargs="?", const=1000, default=0, metavar="N",
                        help="also print where time and memory go: the phase share of the "
                             "latest N requests' time (default 1000), utilisation per phase, "
                             "each worker's memory composition")
    status.add_argument("--timeout", type=float, default=10.0, help="call deadline in seconds")
    add_client_security(status, inference=False, admin=True)


def add_drain(sub) -> None:
    drain = sub.add_parser("drain", help="take a worker out of routing, let it finish its "
                                         "streams, then stop it (its pool target drops by one)")
    drain.add_argument("worker_id", help="as `pdserve status` lists it, e.g. decode-1")
    drain.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    drain.add_argument("--wait", type=float, nargs="?", const=600.0, default=None,
                       metavar="SECONDS", help="return only once the worker has stopped (at "
                                               "most SECONDS, default 600)")
    drain.add_argument("--timeout", type=float, default=10.0, help="call deadline in seconds")
    add_client_security(drain, inference=False, admin=True)


def add_lora(sub) -> None:
    lora = sub.add_parser("lora", help="the LoRA adapters a running server serves: load, "
                                       "unload, list")
    actions = lora.add_subparsers(dest="lora_action", required=True, metavar="ACTION")
    load = actions.add_parser("load", help="register a PEFT LoRA folder under a name that "
                                           "requests put in their model")
    load.add_argument("name", help="the name requests use (model)")
    load.add_argument("path", help="the adapter's folder, as the workers see it")
    unload = actions.add_parser("unload", help="unregister an adapter (requests in flight "
                                               "finish)")
    unload.add_argument("name")
    listing = actions.add_parser("list", help="the registered adapters")
    listing.add_argument("--json", action="store_true", help="one JSON list")
    for parser in (load, unload, listing):
        parser.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
        parser.add_argument("--timeout", type=float, default=60.0,
                            help="call deadline in seconds")
        add_client_security(parser, inference=False, admin=True)


def cmd_lora(args) -> int:
    prog = f"pdserve lora {args.lora_action}"
    security = admin_security(prog, args)
    if args.lora_action == "load":
        adapter = _admin_call(prog, args.target, args.timeout,
                              lambda admin: admin.load_lora_adapter(args.name, args.path),
                              security)
        print(f"pdserve: LoRA adapter {adapter.name!r} loaded from {adapter.path} "
              f"(sha256 {adapter.digest[:12]}...)", file=sys.stderr)
    elif args.lora_action == "unload":
        adapter = _admin_call(prog, args.target, args.timeout,
                              lambda admin: admin.unload_lora_adapter(args.name), security)
        print(f"pdserve: LoRA adapter {adapter.name!r} unloaded", file=sys.stderr)
    else:
        adapters = _admin_call(prog, args.target, args.timeout,
                               lambda admin: admin.list_lora_adapters(), security)
        rows = [{"name": a.name, "path": a.path, "digest": a.digest} for a in adapters]
        if args.json:
            print(json.dumps(rows))
        else:
            print(_table(["name", "path", "sha256"],
                         [[r["name"], r["path"], r["digest"][:12]] for r in rows]))
    return 0


def _admin_call(prog: str, target: str, timeout: float, fn, security: dict | None = None):
    """``fn(AdminClient)``; an unreachable server, an unknown worker, a missing or refused
    admin key or a bad target exits 2 with one line."""


    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        fail(prog, f"argument --target: expected HOST:PORT, got {target!r}")
    try:
        with AdminClient(target, timeout=timeout, **(security or {})) as admin:
            return fn(admin)
    except PdserveError as exc:
        if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            fail(prog, f"cannot reach a pdserve router at {target}: {exc.details}")
        if exc.code == grpc.StatusCode.UNIMPLEMENTED:
            fail(prog, f"the server at {target} has no pdserve.v1.Admin service")
        if exc.code == grpc.StatusCode.UNAUTHENTICATED:
            fail(prog, f"the server at {target} wants its admin key: pass "
                        "--admin-api-key-file FILE (or set PDSERVE_ADMIN_API_KEY)")
        if exc.code == grpc.StatusCode.PERMISSION_DENIED:
            fail(prog, f"the server at {target} refused: {exc.details}")
        fail(prog, exc.details or exc.code.name)


def cmd_status(args) -> int:
    pools, workers, plane = _admin_call(
        "pdserve status", args.target, args.timeout,
        lambda admin: (admin.get_pools(), admin.list_workers(), _control_plane(admin)),
        admin_security("pdserve status", args))
    report = {"pools": {p.role: pool_dict(p) for p in pools},
              "workers": [worker_dict(w) for w in workers],
              "control_plane": None if plane is None else control_plane_dict(plane)}
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    print(_table(["POOL", "TARGET", "ACTUAL", "READY", "STARTING", "DRAINING", "RESTARTS"],
                 [[role, p["target"], p["actual"], p["ready"], p["starting"], p["draining"],
                   p["restarts"]] for role, p in report["pools"].items()]))
    for role, p in report["pools"].items():
        if p["last_error"]:
            print(f"{role}: last failed start: {p['last_error']}")
    if report["control_plane"] is not None:
        print(_control_plane_line(report["control_plane"]))
    print()
    rows = []
    lora = any(w["lora_slots"] for w in report["workers"])  # the LoRA column, only then
    tiers = any(w["kv_host_blocks"] or w["kv_disk_blocks"] for w in report["workers"])  # and
    # the KV tiers column
    for w, raw in zip(report["workers"], workers, strict=True):
        age = w["heartbeat_age_s"]
        rows.append([w["worker_id"], w["role"], w["state"], w["node"] or "-", w["pid"] or "-",
                     _device(w), w["running"], w["waiting"],
                     f"{w['kv_used_blocks']}/{w['kv_total_blocks']}",
                     *([_lora(w)] if lora else []), *([_kv_tiers(w)] if tiers else []),
                     f"{w['compute_utilization']:.1%}", f"{w['bandwidth_utilization']:.1%}",
                     w["binding"] or "-", "-" if age is None else f"{age:.1f}s", w["restarts"],
                     raw.error or ""])
    print(_table(["WORKER", "ROLE", "STATE", "NODE", "PID", "DEVICE", "RUNNING", "WAITING",
                  "KV BLOCKS", *(["LORA"] if lora else []), *(["KV TIERS"] if tiers else []),
                  "COMPUTE", "BANDWIDTH", "BINDS", "HEARTBEAT", "RESTARTS", "ERROR"], rows))
    for w in report["workers"]:
        if w["kv_int8"]:
            print(f"{w['worker_id']}: int8 KV {w['kv_int8']}")
    if args.checklist:

        traces = _admin_call("pdserve status", args.target, args.timeout,
                             lambda admin: _latest_traces(admin, args.checklist),
                             admin_security("pdserve status", args))
        print()
        print(format_checklist(traces, workers))
    return 0


def _lora(worker: dict) -> str:
    """A worker's LoRA column: adapters in a slot / slots ("-": it serves no adapters)."""
    if not worker["lora_slots"]:
        return "-"
    return f"{len(worker['lora_resident'])}/{worker['lora_slots']}"


def _kv_tiers(worker: dict) -> str:
    """A worker's KV tiers column: blocks in host memory / on disk ("-": none held)."""
    host, disk = worker["kv_host_blocks"], worker["kv_disk_blocks"]
    return f"h {host} / d {disk}" if host or disk else "-"


def _control_plane(admin):
    """The router's control plane report; None from a server that has none."""


    try:
        return admin.get_control_plane()
    except PdserveError as exc:
        if exc.code == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise


def _control_plane_line(plane: dict) -> str:
    """One line: whether the router reaches Redis, and what it skipped or put back there."""
    counts = (f" ({plane['malformed_records']} malformed records skipped, "
              f"{plane['repairs']} values re-published so far)"
              if plane["malformed_records"] or plane["repairs"] else "")
    if not plane["degraded"]:
        return f"control plane: ok, Redis reachable{counts}"
    return (f"control plane: DEGRADED for {plane['degraded_for_s']:.1f} s, Redis unreachable "
            f"({plane['error']}): serving with the workers the router knows, pools unchanged "
            f"until Redis is back; check the Redis server and --redis-url{counts}")


def _device(worker: dict) -> str:
    """"cpu x2" (torch threads) or the GPU, as the worker's ledger says, then "TP2" for a
    tensor parallel group (per rank); "-" before its first heartbeat."""
    device = worker["device"]
    if not device:
        return "-"
    ranks = worker["tensor_parallel_size"]
    label = f"{device} x{worker['torch_threads']}" if device == "cpu" else device
    return label if ranks == 1 else f"{label} TP{ranks}"


def _latest_traces(admin, limit: int) -> list | None:
    """The router's latest ``limit`` traces; None from a server that keeps none."""


    try:
        return admin.get_traces(limit=limit)
    except PdserveError as exc:
        if exc.code == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in cells)


def cmd_drain(args) -> int:
    prog = "pdserve drain"
    security = admin_security(prog, args)
    worker = _admin_call(prog, args.target, args.timeout,
                         lambda admin: admin.drain_worker(args.worker_id), security)
    pools = _admin_call(prog, args.target, args.timeout, lambda admin: admin.get_pools(),
                        security)
    target = next((p.target for p in pools if p.role == worker.role), None)
    print(f"pdserve: draining {worker.worker_id}: it takes no new requests, finishes its "
          f"streams, then stops; {worker.role} pool target now {target}", file=sys.stderr)
    if args.wait is None:
        return 0
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        workers = _admin_call(prog, args.target, args.timeout,
                              lambda admin: admin.list_workers(), security)
        if not any(w.worker_id == args.worker_id and w.state == worker.state for w in workers):
            print(f"pdserve: {args.worker_id} stopped", file=sys.stderr)
            return 0
        time.sleep(0.5)
    fail(prog, f"{args.worker_id} still draining after {args.wait:.0f} s "
                "(it stops once its last stream ends)")
