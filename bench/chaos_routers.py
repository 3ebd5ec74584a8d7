"""Chaos scenarios of ``python -m pdserve.bench.chaos`` that break routers and processes (see
that module for what each reports):

* ``router-killed``: two routers serve one prefill and one decode worker; while streams run
  through both, the second router's actor is killed (no restart). Its requests must be freed
  on the workers by the per-router orphan clock (``orphan_timeout_s`` :data:`ORPHAN_S`) while
  the first router keeps polling; the first router's streams must finish with the offline
  engine's tokens. Sent/completed/failed count the first router's streams. Recovery: from the
  kill until no decode worker holds anything of the killed router.
* ``sigterm-under-load``: ``pdserve serve`` as a subprocess (its own Ray and Redis), 16
  streams running (6 short ones done by then), then SIGTERM twice in a row. Streams cut by the
  stop fail; the ones done before it count as completed. Recovery: from the first SIGTERM
  until the process and every process it started are gone (the note says how many error
  lines it logged).
* ``workers-restarting``: the only decode worker is SIGKILLed under streams, and a second wave
  of requests arrives while its replacement starts: every request waits for it (the streams
  on the dead worker migrate to it) instead of failing. Recovery: from the kill until health
  reports SERVING again.

The helpers (:func:`kill_router`, :func:`decode_mailboxes`, :func:`forgotten_by_decode_workers`,
:func:`sigterm_and_wait`, :func:`error_lines`) are what ``tests/e2e/test_routers.py`` and
``tests/e2e/test_cli_serve.py`` drive too.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from pdserve.api.client import AsyncPdserveClient
from pdserve.bench.failover import (
    ScenarioResult,
    StreamRecord,
    chaos_requests,
    reference_tokens,
    sigkill_busiest,
    stream_all,
    stream_one,
    tally,
)
from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster
from pdserve.cluster.processes import wait_gone
from pdserve.router.core import RouterConfig
from pdserve.testing.waits import wait_for

ORPHAN_S = 2.0  # router-killed: the workers' orphan_timeout_s
BOUND_S = 60.0  # a scenario that has not recovered by then reports no recovery
ENGINE = dict(dtype="float32", memory_budget_bytes=512 << 20)
ERROR_LINE = re.compile(r"\bERROR\b|\bCRITICAL\b|Traceback|^\[[^]]* E \d+ \d+\]", re.MULTILINE)


# -- router-killed --------------------------------------------------------------------------
def kill_router(cluster, index: int) -> None:
    """Kill router ``index``'s actor for good (Ray does not restart it)."""
    cluster._ray.kill(cluster.routers[index], no_restart=True)


def decode_mailboxes(cluster) -> list:
    """Every live decode worker's ``MailboxSizes``."""
    cluster.refresh_workers()
    refs = [actor.mailbox_sizes.remote() for wid, actor in cluster.workers.items()
            if wid.startswith("decode")]
    return cluster._ray.get(refs, timeout=30)


def forgotten_by_decode_workers(cluster, num_routers: int) -> bool:
    """Every decode worker knows at most ``num_routers`` routers (a dead one is forgotten)."""
    return all(s.num_routers <= num_routers for s in decode_mailboxes(cluster))


async def _two_routers(cluster, survivor, doomed) -> tuple[list[StreamRecord], float | None]:
    """Stream ``survivor`` through the first router and ``doomed`` through the second; kill
    the second once streams run; returns the survivor's records and kill -> freed time."""

    freed: list[float] = []

    def fault() -> None:
        killed = time.monotonic()
        kill_router(cluster, 1)
        wait_for(lambda: forgotten_by_decode_workers(cluster, 1), BOUND_S,
                 "the killed router forgotten by every decode worker", 0.05)
        freed.append(time.monotonic() - killed)

    async with AsyncPdserveClient(cluster.targets[1]) as client:
        lost = [StreamRecord(r.request_id) for r in doomed]
        doomed_tasks = [asyncio.create_task(stream_one(client, r, rec, 60))
                        for r, rec in zip(doomed, lost, strict=True)]
        records, _ = await stream_all(cluster.targets[0], survivor, fault,
                                      fault_after_streams=2)
        await asyncio.gather(*doomed_tasks)
    return records, (freed[0] if freed else None)


def run_router_killed(model_dir: str, seed: int) -> ScenarioResult:
    options = ClusterOptions(model=model_dir, num_prefill=1, num_decode=1, num_routers=2,
                             port=0, metrics_port=None, orphan_timeout_s=ORPHAN_S,
                             router=RouterConfig(stats_interval_s=0.1), engine=ENGINE)
    survivor = chaos_requests(16, seed, prefix="keep")
    doomed = chaos_requests(8, seed + 1, prefix="doomed", min_tokens=800, max_tokens=1200)
    expected = reference_tokens(model_dir, survivor)
    with EmbeddedCluster(options) as cluster:
        cluster.wait_ready(120)
        records, freed_s = asyncio.run(_two_routers(cluster, survivor, doomed))
    return tally("router-killed", records, expected, freed_s,
                 f"the first router's streams; recovery: kill -> the second router's "
                 f"{len(doomed)} requests freed (orphan_timeout_s {ORPHAN_S:g})")


# -- sigterm-under-load ---------------------------------------------------------------------
def start_serve(args: list[str], log: Path, timeout: float = 150.0
                ) -> tuple[subprocess.Popen, str]:
    """``pdserve serve ARGS`` as a subprocess (its own local Ray and Redis), stderr to
    ``log``; returns (process, gRPC target) once it serves."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "pdserve.cli.main", "serve",
                                 *args], stdout=subprocess.DEVNULL, stderr=err, env=env)
    deadline = time.monotonic() + timeout
    while not (match := re.search(r"gRPC on [^\s]+:(\d+)", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"pdserve serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{match.group(1)}"


def process_tree(proc: subprocess.Popen) -> set[int]:
    """``proc`` and every process under it now."""
    try:
        return {proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def sigterm_and_wait(proc: subprocess.Popen, times: int = 1, gap_s: float = 0.2,
                     timeout: float = 30.0) -> tuple[float | None, set[int]]:
    """SIGTERM ``proc`` ``times`` times ``gap_s`` apart; returns (seconds from the first
    SIGTERM until it and every process it had are gone, or None; the pids still running)."""

    tree = process_tree(proc)
    start = time.monotonic()
    for i in range(times):
        if i:
            time.sleep(gap_s)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    left = wait_gone(tree - {proc.pid}, max(0.0, start + timeout - time.monotonic()))
    return (None if left else time.monotonic() - start), left


def error_lines(log: Path) -> list[str]:
    """The error-level lines of a ``pdserve serve`` log (ours, Ray's, tracebacks)."""
    return [m.group(0) for m in ERROR_LINE.finditer(log.read_text(errors="replace"))]


def run_sigterm_under_load(model_dir: str, seed: int) -> ScenarioResult:
    requests = (chaos_requests(6, seed, prefix="short", min_tokens=16, max_tokens=24)
                + chaos_requests(10, seed + 1, prefix="long", min_tokens=300, max_tokens=400))
    expected = reference_tokens(model_dir, requests)
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as folder:
        log = Path(folder, "serve.err")
        proc, target = start_serve(["--model", model_dir, "--port", "0", "--metrics-port", "0",
                                    "--memory-budget-mib", "512"], log)
        stopped: list[tuple[float | None, set[int]]] = []
        records, _ = asyncio.run(stream_all(
            target, requests, lambda: stopped.append(sigterm_and_wait(proc, times=2)),
            fault_after_tokens=32, fault_after_streams=8, timeout=60))  # the short ones done
        seconds, left = stopped[0]
        errors = error_lines(log)
    return tally("sigterm-under-load", records, expected, seconds,
                 f"recovery: 1st of 2 SIGTERMs -> all processes gone ({len(left)} left, "
                 f"{len(errors)} error lines); streams cut by the stop fail")


# -- workers-restarting ---------------------------------------------------------------------
async def _waves(cluster, first, second) -> tuple[list[StreamRecord], float | None]:
    """``first`` under way, SIGKILL the only decode worker, ``second`` once the router saw it
    go; returns every record and kill -> SERVING again."""

    ray, router = cluster._ray, cluster.router
    serving = lambda: ray.get(router.is_serving.remote(), timeout=30)  # noqa: E731
    records = [StreamRecord(r.request_id) for r in [*first, *second]]
    async with AsyncPdserveClient(cluster.target) as client:
        tasks = [asyncio.create_task(stream_one(client, r, rec, 120))
                 for r, rec in zip(first, records[:len(first)], strict=True)]
        await asyncio.to_thread(wait_for, lambda: sum(len(r.token_ids) >= 4 for r in records)
                                >= 4, BOUND_S, "streams under way", 0.01)
        killed = time.monotonic()
        await asyncio.to_thread(sigkill_busiest(cluster, "decode"))
        await asyncio.to_thread(wait_for, lambda: not serving(), BOUND_S, "NOT_SERVING", 0.02)
        tasks += [asyncio.create_task(stream_one(client, r, rec, 120))
                  for r, rec in zip(second, records[len(first):], strict=True)]
        await asyncio.to_thread(wait_for, serving, BOUND_S, "SERVING again", 0.05)
        back_s = time.monotonic() - killed
        await asyncio.gather(*tasks)
    return records, back_s


def run_workers_restarting(model_dir: str, seed: int) -> ScenarioResult:
    options = ClusterOptions(model=model_dir, num_prefill=1, num_decode=1, port=0,
                             metrics_port=None, engine=ENGINE,
                             router=RouterConfig(stats_interval_s=0.1, worker_wait_s=BOUND_S))
    first = chaos_requests(8, seed, prefix="before")
    second = chaos_requests(8, seed + 1, prefix="during")
    expected = reference_tokens(model_dir, [*first, *second])
    with EmbeddedCluster(options) as cluster:
        cluster.wait_ready(120)
        records, back_s = asyncio.run(_waves(cluster, first, second))
    return tally("workers-restarting", records, expected, back_s,
                 f"{len(second)} of them sent while no decode worker was ready; recovery: "
                 f"kill -> SERVING again")


SCENARIOS: dict[str, Callable] = {  # name -> (model_dir, seed) -> failover.ScenarioResult
    "router-killed": run_router_killed,
    "sigterm-under-load": run_sigterm_under_load,
    "workers-restarting": run_workers_restarting,
}
