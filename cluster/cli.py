"""The ``pdserve`` command line (DESIGN.md sections 4 and 7): ``serve``, ``generate``,
``demo``, the operator commands ``status`` and ``drain`` (clients of ``pdserve.v1.Admin``),
``bench serve`` / ``bench compare`` (load benchmarks) and ``plan`` (the capacity planner).

Output to the terminal happens only in the ``_print_*`` / ``_cmd_*`` functions here; the rest
of pdserve logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading

logger = logging.getLogger(__name__)
SETTINGS_HELP = ("Every setting is a field of EngineConfig, RouterConfig or ClusterOptions; only "
                 "the flags given override their defaults.")


class _Parser(argparse.ArgumentParser):
    """Errors are one line and exit 2; ``populate(parser)`` adds the flags on first use, so
    commands that never see the generated settings don't import what they are made from."""

    def __init__(self, *args, populate=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _ensure_populated(self) -> None:
        populate, self._populate = self._populate, None
        if populate is not None:
            populate(self)

    def parse_known_args(self, args=None, namespace=None):
        self._ensure_populated()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._ensure_populated()
        return super().format_help()

    def error(self, message: str):
        _fail(self.prog, message)


def _fail(prog: str, message: str):
    """A user error: one line on stderr, exit code 2 (as argparse's own errors)."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _serve_settings(parser: argparse.ArgumentParser) -> None:
    from pdserve.cluster.options import ClusterOptions
    from pdserve.cluster.settings import add_setting_flags

    add_setting_flags(parser, ClusterOptions())


def _add_serve(sub) -> None:
    sub.add_parser("serve", help="serve a model over gRPC until SIGINT/SIGTERM",
                   usage="%(prog)s [settings]", description=SETTINGS_HELP,
                   populate=_serve_settings)


def _add_client_security(parser) -> None:
    """--api-key and the TLS files of a client command."""
    parser.add_argument("--api-key", default=None,
                        help="the server's API key (default: $PDSERVE_API_KEY)")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="speak TLS, verifying the server with this PEM CA file")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="this client's PEM certificate, for mutual TLS (with --tls-key)")
    parser.add_argument("--tls-key", default=None, metavar="FILE",
                        help="this client's PEM private key")


def _client_security(prog: str, args) -> dict:
    """{"api_key", "tls"} for a client from --api-key / --tls-* (one-line exit 2 when bad)."""
    import os

    from pdserve.api.client import ClientTLS

    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY") or None
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        try:
            tls = ClientTLS.from_files(args.tls_ca, args.tls_cert, args.tls_key)
        except (OSError, ValueError) as exc:
            _fail(prog, f"argument --tls-ca/--tls-cert/--tls-key: {exc}")
    return {"api_key": api_key, "tls": tls}


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    _add_client_security(gen)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None,
                     help="stop string (repeat for several)")
    gen.add_argument("--ignore-eos", action="store_true", default=None)
    gen.add_argument("--priority", type=int, default=None, help="lower runs earlier (default 0)")
    gen.add_argument("--tenant", default="", help="who sends it (fair share between tenants)")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def _demo_settings(parser: argparse.ArgumentParser) -> None:
    from pdserve.cluster.demo import demo_options
    from pdserve.cluster.settings import add_setting_flags

    add_setting_flags(parser, demo_options())


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="start the embedded cluster, send real traffic, report",
                          usage="%(prog)s [--requests N] [--concurrency N] [--offline] "
                                "[settings]",
                          description=f"{SETTINGS_HELP} --seed also seeds the prompts.",
                          populate=_demo_settings)
    demo.add_argument("--requests", type=int, default=48, help="number of requests to send")
    demo.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    demo.add_argument("--offline", action="store_true",
                      help="the engine alone in this process (no Ray, Redis or gRPC); takes "
                           "the engine settings")


def _add_status(sub) -> None:
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
    _add_client_security(status)


def _add_drain(sub) -> None:
    drain = sub.add_parser("drain", help="take a worker out of routing, let it finish its "
                                         "streams, then stop it (its pool target drops by one)")
    drain.add_argument("worker_id", help="as `pdserve status` lists it, e.g. decode-1")
    drain.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    drain.add_argument("--wait", type=float, nargs="?", const=600.0, default=None,
                       metavar="SECONDS", help="return only once the worker has stopped (at "
                                               "most SECONDS, default 600)")
    drain.add_argument("--timeout", type=float, default=10.0, help="call deadline in seconds")
    _add_client_security(drain)


def _add_bench(sub) -> None:
    from pdserve.bench.flags import add_compare_flags, add_serve_flags

    bench = sub.add_parser("bench", help="load benchmarks: serve (a running server), compare "
                                         "(disaggregated vs colocated)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,compare}")
    serve = kinds.add_parser("serve", help="send a seeded trace to a running server; vLLM's "
                                           "bench serve result keys plus the phase split")
    add_serve_flags(serve)
    _add_client_security(serve)
    compare = kinds.add_parser("compare", help="disaggregated (1P+1D) vs colocated (2 workers) "
                                               "on the embedded cluster at a sweep of rates; "
                                               "JSON and PNG plots")
    add_compare_flags(compare)


def _add_plan(sub) -> None:
    from pdserve.bench.flags import add_plan_flags

    plan = sub.add_parser("plan", help="capacity plan from config.json: KV bytes, max batch, "
                                       "roofline step times, binding resource, worker counts")
    add_plan_flags(plan)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("--log-level", default="WARNING", help="logging level (INFO, DEBUG, ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_demo(sub)
    _add_status(sub)
    _add_drain(sub)
    _add_bench(sub)
    _add_plan(sub)
    return parser


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM: raise KeyboardInterrupt in the main thread (interrupts a start too)."""

    def handler(signum, _frame):
        if not stop.is_set():
            stop.set()
            raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _checked_options(args, base, prog: str):
    """The ClusterOptions the flags ask for, every config built and the engine's memory plan
    checked in this process (:mod:`pdserve.cluster.preflight`) before anything starts; a user
    error exits 2 with one message naming the flags that fix it."""
    from pdserve.cluster.preflight import check_cluster
    from pdserve.cluster.settings import SettingsError, name_flags, options_from_args
    from pdserve.engine.memory import MemoryBudgetError
    from pdserve.models import tiny_model_dir

    try:
        options = options_from_args(args, dataclasses.replace(base, log_level=args.log_level))
        check_cluster(options, options.model or str(tiny_model_dir()))
    except (SettingsError, MemoryBudgetError) as exc:
        _fail(prog, str(exc))
    except FileNotFoundError as exc:
        _fail(prog, f"argument --model: {exc}")
    except ValueError as exc:  # the model's own limits, or what its folder holds
        named = name_flags("engine", str(exc))
        _fail(prog, named if named != str(exc) else f"argument --model: {exc}")
    return options


def _cmd_serve(args) -> int:
    from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster
    from pdserve.cluster.preflight import user_error

    options = _with_security(_checked_options(args, ClusterOptions(), "pdserve serve"),
                             "pdserve serve")
    stop = threading.Event()
    _stop_on_signals(stop)
    cluster = EmbeddedCluster(options)
    failure = None
    try:
        cluster.start_infra()
        _stop_on_signals(stop)  # again: a local Ray's core installed its own handlers
        cluster.start_router()
        cluster.start_workers()
        cluster.wait_ready(120)
        from pdserve.cluster.redis_server import redact_url

        http = f", OpenAI HTTP on {cluster.http_url}/v1" if cluster.http_url else ""
        print(f"pdserve: serving {cluster.model} with {_shape(options)} worker(s)\n"
              f"pdserve: gRPC on {options.host}:{cluster.port}{http}, metrics on "
              f"{cluster.metrics_url}, Redis {redact_url(cluster.redis_url)}\n"
              f"pdserve: {_security_line(options)}\n"
              f"pdserve: Ctrl-C or SIGTERM stops everything", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # a worker's user error (MemoryBudgetError) becomes one message
        failure = user_error(exc)
        if failure is None:
            raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("pdserve: stopping", file=sys.stderr, flush=True)
        cluster.stop()
    if failure is not None:
        _fail("pdserve serve", str(failure))
    return 0


def _with_security(options, prog: str):
    """``options`` with the API key from $PDSERVE_API_KEY when no --api-key was given (and the
    Redis URL from $PDSERVE_REDIS_URL when no --redis-url was), and the TLS files checked
    readable (exit 2 naming the flag otherwise)."""
    import os

    from pdserve.router.auth import TLSConfig

    key = os.environ.get("PDSERVE_API_KEY")
    if options.api_key is None and key:
        try:
            options = dataclasses.replace(options, api_key=key)
        except ValueError as exc:
            _fail(prog, f"PDSERVE_API_KEY: {exc}")
    redis_url = os.environ.get("PDSERVE_REDIS_URL")
    if options.redis_url is None and redis_url:
        options = dataclasses.replace(options, redis_url=redis_url)
    try:
        TLSConfig.from_files(options.tls_cert, options.tls_key, options.tls_client_ca)
    except ValueError as exc:
        flag = str(exc).split(":", 1)[0].split(" ", 1)[0].replace("_", "-")
        _fail(prog, f"argument --{flag}: {exc}")
    return options


def _security_line(options) -> str:
    parts = ["API key required" if options.api_key else "no API key (anyone who can reach "
             "the port may call it)"]
    if options.tls_cert:
        parts.append("mutual TLS" if options.tls_client_ca else "TLS")
    else:
        parts.append("plaintext")
    return ", ".join(parts)


def _shape(options) -> str:
    if options.colocated:
        return f"{options.num_decode} colocated"
    return f"{options.num_prefill} prefill + {options.num_decode} decode"


def _cmd_generate(args) -> int:
    from pdserve.api.client import PdserveClient, PdserveError

    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=args.stop,
                    ignore_eos=args.ignore_eos, priority=args.priority, tenant=args.tenant)
    security = _client_security("pdserve generate", args)
    try:
        with PdserveClient(args.target, **security) as client:
            finish = None
            for chunk in client.generate_stream(args.prompt, timeout=args.timeout, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                finish = chunk.finish_reason or finish
    except PdserveError as exc:
        print(f"\npdserve: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    print(f"[finish_reason: {finish}]", file=sys.stderr)
    return 0


def _cmd_demo(args) -> int:
    from pdserve.cluster.demo import demo_options
    from pdserve.cluster.settings import engine_config

    options = _checked_options(args, demo_options(), "pdserve demo")
    seed = engine_config(options).seed
    if args.offline:
        from pdserve.cluster.offline_demo import run_offline_demo

        run_offline_demo(num_requests=args.requests, seed=seed, model=options.model,
                         engine=options.engine)
        return 0
    from pdserve.cluster.demo import format_report, run_demo

    model = options.model or "built-in tiny model, random weights"
    print(f"pdserve demo: starting Ray, Redis, {_shape(options)} worker(s) and the router "
          f"({model})...", flush=True)
    try:
        report = run_demo(num_requests=args.requests, concurrency=args.concurrency, seed=seed,
                          options=options)
    except Exception as exc:  # a worker's user error (MemoryBudgetError) becomes one message
        from pdserve.cluster.preflight import user_error

        failure = user_error(exc)
        if failure is None:
            raise
        _fail("pdserve demo", str(failure))
    print(format_report(report))
    print("\ncluster stopped")
    return 0


def _admin_call(prog: str, target: str, timeout: float, fn, security: dict | None = None):
    """``fn(AdminClient)``; an unreachable server, an unknown worker, a wrong API key or a bad
    target exits 2 with one line."""
    import grpc

    from pdserve.api.admin_client import AdminClient
    from pdserve.api.client import PdserveError

    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        _fail(prog, f"argument --target: expected HOST:PORT, got {target!r}")
    try:
        with AdminClient(target, timeout=timeout, **(security or {})) as admin:
            return fn(admin)
    except PdserveError as exc:
        if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            _fail(prog, f"cannot reach a pdserve router at {target}: {exc.details}")
        if exc.code == grpc.StatusCode.UNIMPLEMENTED:
            _fail(prog, f"the server at {target} has no pdserve.v1.Admin service")
        if exc.code == grpc.StatusCode.UNAUTHENTICATED:
            _fail(prog, f"the server at {target} wants an API key: pass --api-key (or set "
                        "PDSERVE_API_KEY)")
        _fail(prog, exc.details or exc.code.name)


def _cmd_status(args) -> int:
    import json

    from pdserve.api.admin_client import pool_dict, worker_dict

    pools, workers = _admin_call("pdserve status", args.target, args.timeout,
                                 lambda admin: (admin.get_pools(), admin.list_workers()),
                                 _client_security("pdserve status", args))
    report = {"pools": {p.role: pool_dict(p) for p in pools},
              "workers": [worker_dict(w) for w in workers]}
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    print(_table(["POOL", "TARGET", "ACTUAL", "READY", "STARTING", "DRAINING", "RESTARTS"],
                 [[role, p["target"], p["actual"], p["ready"], p["starting"], p["draining"],
                   p["restarts"]] for role, p in report["pools"].items()]))
    for role, p in report["pools"].items():
        if p["last_error"]:
            print(f"{role}: last failed start: {p['last_error']}")
    print()
    rows = []
    for w, raw in zip(report["workers"], workers, strict=True):
        age = w["heartbeat_age_s"]
        rows.append([w["worker_id"], w["role"], w["state"], w["node"] or "-", w["pid"] or "-",
                     _device(w), w["running"], w["waiting"],
                     f"{w['kv_used_blocks']}/{w['kv_total_blocks']}",
                     f"{w['compute_utilization']:.1%}", f"{w['bandwidth_utilization']:.1%}",
                     w["binding"] or "-", "-" if age is None else f"{age:.1f}s", w["restarts"],
                     raw.error or ""])
    print(_table(["WORKER", "ROLE", "STATE", "NODE", "PID", "DEVICE", "RUNNING", "WAITING",
                  "KV BLOCKS",
                  "COMPUTE", "BANDWIDTH", "BINDS", "HEARTBEAT", "RESTARTS", "ERROR"], rows))
    if args.checklist:
        from pdserve.cluster.checklist import format_checklist

        traces = _admin_call("pdserve status", args.target, args.timeout,
                             lambda admin: _latest_traces(admin, args.checklist),
                             _client_security("pdserve status", args))
        print()
        print(format_checklist(traces, workers))
    return 0


def _device(worker: dict) -> str:
    """"cpu x2" (torch threads) or the GPU, as the worker's ledger says; "-" before it."""
    device = worker["device"]
    if not device:
        return "-"
    return f"{device} x{worker['torch_threads']}" if device == "cpu" else device


def _latest_traces(admin, limit: int) -> list | None:
    """The router's latest ``limit`` traces; None from a server that keeps none."""
    import grpc

    from pdserve.api.client import PdserveError

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


def _cmd_drain(args) -> int:
    import time

    prog = "pdserve drain"
    security = _client_security(prog, args)
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
    _fail(prog, f"{args.worker_id} still draining after {args.wait:.0f} s "
                "(it stops once its last stream ends)")


def _cmd_bench(args) -> int:
    return {"serve": _cmd_bench_serve, "compare": _cmd_bench_compare}[args.bench_command](args)


def _cmd_bench_serve(args) -> int:
    from pdserve.api.client import PdserveError
    from pdserve.bench.flags import serve_options
    from pdserve.bench.report import dump_json, format_serve
    from pdserve.bench.serve import run_serve

    prog = "pdserve bench serve"
    try:
        options = serve_options(args, _client_security(prog, args))
        result = run_serve(options)
    except PdserveError as exc:
        _fail(prog, f"the server at {args.target} did not serve: {exc.details or exc.code.name}")
    except (OSError, ValueError) as exc:
        _fail(prog, str(exc))
    print(format_serve(result))
    if args.save_result:
        dump_json(result, args.save_result)
        print(f"pdserve: result written to {args.save_result}", file=sys.stderr)
    return 0


def _cmd_bench_compare(args) -> int:
    from pdserve.bench.compare import COMPARE_SHAPE, CompareOptions, run_compare
    from pdserve.bench.flags import shape_from_args
    from pdserve.bench.report import format_compare

    prog = "pdserve bench compare"
    given = {k: v for k, v in dict(
        rates=args.rates, num_prompts=args.num_prompts, memory_budget_mib=args.memory_budget_mib,
        max_num_batched_tokens=args.max_num_batched_tokens).items() if v is not None}
    try:
        options = CompareOptions(
            model=args.model, seed=args.seed, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, shape=shape_from_args(args, COMPARE_SHAPE),
            dataset=args.dataset, dataset_path=args.dataset_path,
            goodput=dict(args.goodput or ()), output_dir=args.output_dir,
            disable_tqdm=args.disable_tqdm, from_result=args.from_result, **given)
    except ValueError as exc:
        _fail(prog, str(exc))
    if options.from_result is None:
        print(f"pdserve bench compare: {len(options.rates)} rates x {options.num_prompts} "
              "requests, disaggregated (1 prefill + 1 decode) and colocated (2 workers), "
              "interleaved...", flush=True)
    try:
        doc = run_compare(options)
    except (OSError, KeyError, ValueError) as exc:
        if options.from_result is None:
            raise
        _fail(prog, f"argument --from-result: cannot read {options.from_result}: {exc}")
    print(format_compare(doc))
    print(f"\nwrote {options.output_dir}/compare.json and " + ", ".join(
        p.rsplit("/", 1)[-1] for p in doc["plots"]))
    if args.save_result:
        from pdserve.bench.report import dump_json

        dump_json(doc, args.save_result)
    return 0


def _cmd_plan(args) -> int:
    import json

    from pdserve.bench.plan import DEFAULT_MFU, PlanRequest, make_plan
    from pdserve.bench.plan_measure import choose_hardware, measure
    from pdserve.bench.report import finite, format_measure, format_plan
    from pdserve.engine.config import EngineConfig
    from pdserve.models import ModelConfig, tiny_model_dir

    prog = "pdserve plan"
    model = args.model or str(tiny_model_dir())
    margin = args.memory_safety_margin
    if margin is None:  # the seed's arithmetic, or the engine's own margin when measuring
        margin = EngineConfig(model="").memory_safety_margin if args.measure else 0.0
    try:
        mc = ModelConfig.from_dir(model)
        reserve = args.activation_reserve_gib
        req = PlanRequest(model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          kv_int8_keep_edge_layers=args.kv_int8_keep_edge_layers,
                          block_size=args.block_size, max_model_len=args.max_model_len,
                          avg_context=args.avg_context,
                          activation_reserve_bytes=None if reserve is None
                          else int(reserve * (1 << 30)), memory_safety_margin=margin,
                          mfu=args.mfu or (1.0 if args.measure else DEFAULT_MFU),
                          rate=args.rate, isl=args.isl, osl=args.osl)
        device = (args.device or ("cuda" if _has_cuda() else "cpu")).lower()
        if args.measure and device not in ("cpu", "cuda"):
            raise ValueError("--measure profiles this machine: use --device cpu or cuda")
        kind = "cpu" if device == "cpu" else "cuda"  # named accelerators are CUDA devices
        dtype = req.engine_config(kind).resolve_dtype(mc.torch_dtype, _torch_device(kind))
        hw = choose_hardware(args.device, args.hbm_gib, args.hbm_gbps, args.tflops, dtype)
        plan = make_plan(req, hw, mc)
    except FileNotFoundError as exc:
        _fail(prog, f"argument --model: {exc}")
    except ValueError as exc:
        _fail(prog, str(exc))
    measured = measure(req, hw, plan) if args.measure else None
    if args.json:
        print(json.dumps(finite({**plan, **({"measured": measured} if measured else {})}),
                         sort_keys=True))
        return 0
    print(format_plan(plan))
    if measured is not None:
        print("\npredicted against measured on this machine")
        print(format_measure(measured))
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _torch_device(kind: str):
    import torch

    return torch.device(kind)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = {"serve": _cmd_serve, "generate": _cmd_generate, "demo": _cmd_demo,
               "status": _cmd_status, "drain": _cmd_drain, "bench": _cmd_bench,
               "plan": _cmd_plan}
    return command[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
