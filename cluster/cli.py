"""The ``pdserve`` command line (DESIGN.md section 4): ``serve``, ``generate``, ``demo``.

Output to the terminal happens only in the ``_print_*`` / ``_cmd_*`` functions here; the rest
of pdserve logs.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

logger = logging.getLogger(__name__)


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model over gRPC until SIGINT/SIGTERM")
    serve.add_argument("--model", default=None,
                       help="Hugging Face checkpoint folder (default: the built-in tiny model, "
                            "random weights)")
    serve.add_argument("--prefill", type=int, default=1, help="prefill workers")
    serve.add_argument("--decode", type=int, default=1,
                       help="decode workers (colocated workers with --colocated)")
    serve.add_argument("--colocated", action="store_true",
                       help="workers do both phases (no disaggregation)")
    serve.add_argument("--host", default="127.0.0.1", help="gRPC and metrics bind address")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free)")
    serve.add_argument("--metrics-port", type=int, default=9400,
                       help="Prometheus /metrics port (0 = any free)")
    serve.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (default: start a local Ray on loopback)")
    serve.add_argument("--redis-url", default=None,
                       help="use this Redis (default: a redis-server child on loopback)")
    serve.add_argument("--memory-budget-mib", type=int, default=None,
                       help="per-worker memory for weights + KV pool + activations (default: "
                            "free device memory on CUDA, 4096 on CPU)")


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None,
                     help="stop string (repeat for several)")
    gen.add_argument("--ignore-eos", action="store_true", default=None)
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("--log-level", default="WARNING", help="logging level (INFO, DEBUG, ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    demo = sub.add_parser("demo", help="start the embedded cluster, send real traffic, report")
    demo.add_argument("--requests", type=int, default=48, help="number of requests to send")
    demo.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--offline", action="store_true",
                      help="the engine alone in this process (no Ray, Redis or gRPC)")
    return parser


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM: raise KeyboardInterrupt in the main thread (interrupts a start too)."""

    def handler(signum, _frame):
        if not stop.is_set():
            stop.set()
            raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _cmd_serve(args) -> int:
    from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster

    engine = {}
    if args.memory_budget_mib is not None:
        engine["memory_budget_bytes"] = args.memory_budget_mib << 20
    options = ClusterOptions(model=args.model, num_prefill=args.prefill,
                             num_decode=args.decode, colocated=args.colocated, host=args.host,
                             port=args.port, metrics_port=args.metrics_port,
                             ray_address=args.ray_address, redis_url=args.redis_url,
                             engine=engine, log_level=args.log_level)
    stop = threading.Event()
    _stop_on_signals(stop)
    cluster = EmbeddedCluster(options)
    try:
        cluster.start_infra()
        _stop_on_signals(stop)  # again: a local Ray's core installed its own handlers
        cluster.start_router()
        cluster.start_workers()
        cluster.wait_ready(120)
        shape = (f"{args.decode} colocated" if args.colocated
                 else f"{args.prefill} prefill + {args.decode} decode")
        print(f"pdserve: serving {cluster.model} with {shape} worker(s)\n"
              f"pdserve: gRPC on {args.host}:{cluster.port}, metrics on "
              f"{cluster.metrics_url}, Redis {cluster.redis_url}\n"
              f"pdserve: Ctrl-C or SIGTERM stops everything", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("pdserve: stopping", file=sys.stderr, flush=True)
        cluster.stop()
    return 0


def _cmd_generate(args) -> int:
    from pdserve.api.client import PdserveClient, PdserveError

    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=args.stop,
                    ignore_eos=args.ignore_eos)
    try:
        with PdserveClient(args.target) as client:
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
    if args.offline:
        from pdserve.cluster.offline_demo import run_offline_demo

        run_offline_demo(num_requests=args.requests, seed=args.seed)
        return 0
    from pdserve.cluster.demo import format_report, run_demo

    print("pdserve demo: starting Ray, Redis, 1 prefill + 1 decode worker and the router "
          "(built-in tiny model, random weights)...", flush=True)
    report = run_demo(num_requests=args.requests, concurrency=args.concurrency, seed=args.seed)
    print(format_report(report))
    print("\ncluster stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = {"serve": _cmd_serve, "generate": _cmd_generate, "demo": _cmd_demo}
    return command[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
