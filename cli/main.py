"""The ``pdserve`` command line (docs/interfaces.md): ``serve``, ``generate``,
``demo``, the operator commands ``status`` and ``drain`` (clients of ``pdserve.v1.Admin``),
``bench serve`` / ``bench compare`` (load benchmarks) and ``plan`` (the capacity planner).

The operator commands live in ``cli/admin.py``, the benchmark and planner commands in
``cli/bench.py``, what they share in ``cli/common.py``. Output to the terminal happens only in
the command functions of these modules; the rest of pdserve logs.

Importing this module loads neither torch nor ray (seconds between them): ``--help``,
``status``, ``drain``, ``generate`` and ``bench serve`` need neither, so the commands that do
import their heavy modules where they run (``tests/test_layout.py`` pins it).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading

from pdserve.api.client import PdserveClient, PdserveError
from pdserve.cli.admin import add_drain, add_lora, add_status, cmd_drain, cmd_lora, cmd_status
from pdserve.cli.bench import add_bench, add_plan, cmd_bench, cmd_plan
from pdserve.cli.common import (
    add_client_security,
    client_security,
    fail,
    refuse_secret_flags,
    refuse_secret_in_argv,
)
from pdserve.cluster.credentials import SecretError, resolve_secrets
from pdserve.cluster.options import ClusterOptions
from pdserve.cluster.redis_server import redact_url

logger = logging.getLogger(__name__)
SETTINGS_HELP = ("Every setting is a field of EngineConfig, RouterConfig or ClusterOptions; only "
                 "the flags given override their defaults. Secrets come from files or the "
                 "environment, never flags: --api-key-file / PDSERVE_API_KEY, "
                 "--admin-api-key-file / PDSERVE_ADMIN_API_KEY, --priority-api-key-file / "
                 "PDSERVE_PRIORITY_API_KEYS, --redis-password-file / PDSERVE_REDIS_PASSWORD, "
                 "PDSERVE_REDIS_URL.")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SERVER_SECRET_FLAGS = ("--api-key", "--admin-api-key", "--priority-api-key", "--redis-password")


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
        fail(self.prog, message)


def _serve_settings(parser: argparse.ArgumentParser) -> None:
    # lazy: torch (see the module docstring)
    from pdserve.cli.settings import add_setting_flags

    add_setting_flags(parser, ClusterOptions())
    refuse_secret_flags(parser, *SERVER_SECRET_FLAGS)


def _add_serve(sub) -> None:
    sub.add_parser("serve", help="serve a model over gRPC until SIGINT/SIGTERM",
                   usage="%(prog)s [settings]", description=SETTINGS_HELP,
                   populate=_serve_settings)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="stream a completion from a running server")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--target", default="127.0.0.1:50051", help="server HOST:PORT")
    add_client_security(gen)
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
    # lazy: torch (see the module docstring)
    from pdserve.cli.demo import demo_options
    from pdserve.cli.settings import add_setting_flags

    add_setting_flags(parser, demo_options())
    refuse_secret_flags(parser, *SERVER_SECRET_FLAGS)


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


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from "
                                         f"{', '.join(LOG_LEVELS)})")
    return text.upper()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("--log-level", default="WARNING", type=_log_level,
                        help=f"logging level: {', '.join(LOG_LEVELS)} (any case)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_demo(sub)
    add_status(sub)
    add_drain(sub)
    add_lora(sub)
    add_bench(sub)
    add_plan(sub)
    return parser


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM: raise KeyboardInterrupt in the main thread (interrupts a start too;
    a local Ray's init hands a SIGTERM on to this handler, ``ray_env``); later ones are
    ignored: the stop under way is bounded (``--stop-timeout-s``)."""

    def handler(signum, _frame):
        if not stop.is_set():
            stop.set()
            raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _checked_options(args, base, prog: str, environ=os.environ):
    """The ClusterOptions the flags ask for, with the secrets their files and ``environ``
    give (:mod:`pdserve.cluster.credentials`); every config built, the TLS files read, the
    ports and host checked and the engine's memory plan checked in this process
    (:mod:`pdserve.cli.preflight`) before anything starts. A user error exits 2 with one
    message naming the flags that fix it."""
    # lazy: torch (see the module docstring)
    from pdserve.cli.preflight import check_cluster, check_listen_addresses, check_tls_files
    from pdserve.cli.settings import SettingsError, name_flags, options_from_args
    from pdserve.engine.capacity.memory import MemoryBudgetError
    from pdserve.models import tiny_model_dir

    try:
        options = options_from_args(args, dataclasses.replace(base, log_level=args.log_level))
        refuse_secret_in_argv(options)
        options = resolve_secrets(options, environ)
        check_tls_files(options)
        check_listen_addresses(options)
        check_cluster(options, options.model or str(tiny_model_dir()))
        _check_lora_modules(options, options.model or str(tiny_model_dir()))
    except (SettingsError, SecretError, MemoryBudgetError) as exc:
        fail(prog, str(exc))
    except FileNotFoundError as exc:
        fail(prog, f"argument --model: {exc}")
    except ValueError as exc:  # the model's own limits, or what its folder holds
        named = name_flags("engine", str(exc))
        fail(prog, named if named != str(exc) else f"argument --model: {exc}")
    return options


def _check_lora_modules(options, model_dir: str) -> None:
    """SettingsError naming ``--lora-modules`` for an adapter the cluster cannot serve."""
    # lazy: torch (see the module docstring)
    from pdserve.cli.settings import SettingsError
    from pdserve.cluster.adapters import check_lora_modules

    try:
        check_lora_modules(options, model_dir)
    except ValueError as exc:
        raise SettingsError(f"argument --lora-modules: {exc}") from None


def _cmd_serve(args) -> int:
    # lazy: torch (see the module docstring)
    from pdserve.cli.preflight import user_error
    from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster

    stop = threading.Event()
    _stop_on_signals(stop)
    try:
        options = _checked_options(args, ClusterOptions(), "pdserve serve")
        cluster = EmbeddedCluster(options)
    except KeyboardInterrupt:
        return 0  # stopped before anything started
    failure = None
    try:
        cluster.start_infra()
        cluster.start_router()
        cluster.start_workers()
        cluster.wait_ready(120)
        http = f", OpenAI HTTP on {cluster.http_url}/v1" if cluster.http_url else ""
        grpc = ", ".join(f"{options.host}:{port}" for port in cluster.ports)  # each router's
        print(f"pdserve: serving {cluster.model} with {_shape(options)} worker(s)\n"
              f"pdserve: gRPC on {grpc}{http}, metrics on "
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
        fail("pdserve serve", str(failure))
    return 0


def _security_line(options) -> str:
    parts = ["API key required" if options.api_key or options.priority_api_keys
             else "no API key (anyone who can reach the port may call it, at any priority)"]
    if options.priority_api_keys:
        parts.append(f"{len(options.priority_api_keys)} priority key(s)")
    parts.append("admin key required for Admin and /metrics" if options.admin_api_key
                 else "Admin from this machine only")
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
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=args.stop,
                    ignore_eos=args.ignore_eos, priority=args.priority, tenant=args.tenant)
    security = client_security("pdserve generate", args)
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
    # lazy: torch (see the module docstring)
    from pdserve.cli.demo import demo_options
    from pdserve.cli.settings import engine_config

    # The demo reads only the key files it is given: a PDSERVE_* variable meant for a
    # server must not lock its own traffic out.
    options = _checked_options(args, demo_options(), "pdserve demo", environ={})
    seed = engine_config(options).seed
    if args.offline:
        # lazy: torch (see the module docstring)
        from pdserve.cli.offline_demo import run_offline_demo

        run_offline_demo(num_requests=args.requests, seed=seed, model=options.model,
                         engine=options.engine)
        return 0
    # lazy: torch (see the module docstring)
    from pdserve.cli.demo import format_report, run_demo

    model = options.model or "built-in tiny model, random weights"
    print(f"pdserve demo: starting Ray, Redis, {_shape(options)} worker(s) and the router "
          f"({model})...", flush=True)
    try:
        report = run_demo(num_requests=args.requests, concurrency=args.concurrency, seed=seed,
                          options=options)
    except Exception as exc:  # a worker's user error (MemoryBudgetError) becomes one message
        # lazy: torch (see the module docstring)
        from pdserve.cli.preflight import user_error

        failure = user_error(exc)
        if failure is None:
            raise
        fail("pdserve demo", str(failure))
    print(format_report(report))
    print("\ncluster stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = {"serve": _cmd_serve, "generate": _cmd_generate, "demo": _cmd_demo,
               "status": cmd_status, "drain": cmd_drain, "lora": cmd_lora, "bench": cmd_bench,
               "plan": cmd_plan}
    return command[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
