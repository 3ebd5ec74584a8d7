"""``python -m pdserve.bench.chaos [--scenario NAME ...]``: control-plane faults under traffic.

Each scenario starts its own embedded cluster (real Ray, Redis, gRPC), sends live streams
(``bench.failover``'s traffic), injects one fault of the control plane while they run, and
reports per scenario: requests sent, completed (with the offline engine's tokens), failed, and
the recovery time (from the fault to the cluster serving new requests again at its pool
targets; the scenario says what it waits for). The scenarios live beside this module, grouped
by what they break: Redis (``bench.chaos_redis``) and routers and processes
(``bench.chaos_routers``); each module's ``SCENARIOS`` maps a name to a function
``(model_dir, seed) -> ScenarioResult`` (``bench.failover``, with ``tally``). Never asserts:
the e2e tests do, on the same code.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from pdserve.bench import chaos_redis, chaos_routers
from pdserve.bench.failover import ScenarioResult
from pdserve.bench.stats import format_table
from pdserve.models import tiny_model_dir


def scenarios() -> dict[str, Callable[[str, int], ScenarioResult]]:
    return {**chaos_redis.SCENARIOS, **chaos_routers.SCENARIOS}


def report(results: list[ScenarioResult]) -> str:
    rows = [[r.name, r.sent, r.completed, r.failed,
             "-" if r.recovery_s is None else f"{r.recovery_s:.1f}", r.note] for r in results]
    return format_table(["scenario", "sent", "completed", "failed", "recovery s", "note"], rows)


def main(argv: list[str] | None = None) -> None:
    known = scenarios()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", action="append", choices=sorted(known),
                        help="run only this scenario (repeatable; default: all)")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    model = args.model or str(tiny_model_dir())
    results = [known[name](model, args.seed) for name in (args.scenario or sorted(known))]
    print(report(results))


if __name__ == "__main__":
    main()
