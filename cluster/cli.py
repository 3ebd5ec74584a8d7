"""The ``pdserve`` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    parser.add_argument("--log-level", default="WARNING", help="logging level (INFO, DEBUG, ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job on the embedded default and summarise")
    demo.add_argument("--requests", type=int, default=32, help="number of requests to send")
    demo.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from pdserve.cluster.offline_demo import run_offline_demo

        run_offline_demo(num_requests=args.requests, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
