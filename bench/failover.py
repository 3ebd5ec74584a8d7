"""``python -m pdserve.bench.failover``: what a killed decode worker costs the requests on it.

In one run, on the embedded cluster (1 prefill + 2 decode workers, real Ray, Redis, gRPC):

1. a fault-free pass: ``--requests`` concurrent streams (greedy and seeded sampling, mixed
   lengths) recorded chunk by chunk on the client;
2. the same requests again; once several streams are under way, SIGKILL the decode worker
   running the most of them; every stream must still complete with the fault-free tokens;
3. report, for the requests that migrated (the router's traces say which): the time from the
   kill to each one's first resumed token (P50/P99), and their extra end-to-end latency
   against the same request in the fault-free pass; and how long the pool took to be back
   at its target size.

The traffic helpers (``chaos_requests``, ``stream_all``, ``reference_tokens``) are also what
the e2e chaos tests drive, so the benchmark and the tests exercise the same path.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve import LLM, SamplingParams
from pdserve.api.client import AsyncPdserveClient, PdserveError
from pdserve.bench.stats import format_table, summarize
from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster
from pdserve.router.core import RouterConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChaosRequest:
    """One request of the chaos traffic."""

    request_id: str
    prompt: list[int]  # token ids
    sampling: dict  # AsyncPdserveClient.generate_stream keywords


@dataclass
class StreamRecord:
    """One stream as the client saw it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # monotonic, chunks with tokens
    start: float = 0.0
    end: float = 0.0
    error: str | None = None  # status code name when the stream failed

    @property
    def e2e(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class ScenarioResult:
    """What one chaos scenario (``python -m pdserve.bench.chaos``) did to the traffic."""

    name: str
    sent: int  # requests sent while the fault happened (and after it)
    completed: int  # finished with the offline engine's tokens
    failed: int  # ended with an error status (or wrong tokens)
    recovery_s: float | None  # fault -> serving again at target (None: did not recover)
    note: str = ""  # what recovery means in this scenario, anything unusual


def tally(name: str, records: list[StreamRecord], expected: list[list[int]],
          recovery_s: float | None, note: str = "") -> ScenarioResult:
    """A result from the client's records and the offline tokens, in request order."""
    completed = sum(r.error is None and r.token_ids == want
                    for r, want in zip(records, expected, strict=True))
    return ScenarioResult(name, len(records), completed, len(records) - completed, recovery_s,
                          note)


def chaos_requests(n: int, seed: int = 0, prefix: str = "c", min_tokens: int = 48,
                   max_tokens: int = 96, vocab: int = 400) -> list[ChaosRequest]:
    """Mixed prompt lengths, every other request seeded sampling, the rest greedy."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 48))]
        sampling = dict(max_tokens=rng.randrange(min_tokens, max_tokens + 1), ignore_eos=True)
        if i % 2:
            sampling.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        else:
            sampling.update(temperature=0.0)
        out.append(ChaosRequest(f"{prefix}{i}", prompt, sampling))
    return out


def reference_tokens(model_dir: str, requests: list[ChaosRequest], **engine) -> list[list[int]]:
    """What the offline engine generates for the same requests (seeded draws are keyed by
    (seed, position), so they are the same on any worker)."""

    llm = LLM(model_dir, **{"dtype": "float32", **engine})
    return [llm.generate([r.prompt], SamplingParams(**r.sampling), use_tqdm=False)[0].token_ids
            for r in requests]


async def stream_one(client, request: ChaosRequest, record: StreamRecord, timeout: float) -> None:
    """Stream one request into ``record`` (tokens, chunk times, status code on failure)."""

    record.start = time.monotonic()
    try:
        async for chunk in client.generate_stream(request.prompt, request_id=request.request_id,
                                                  timeout=timeout, **request.sampling):
            if chunk.token_ids:
                record.token_ids += chunk.token_ids
                record.chunk_times.append(time.monotonic())
    except PdserveError as exc:
        record.error = exc.code.name
    record.end = time.monotonic()


async def stream_all(target: str, requests: list[ChaosRequest],
                     fault: Callable[[], object] | None = None, fault_after_tokens: int = 4,
                     fault_after_streams: int = 4,
                     timeout: float = 120.0) -> tuple[list[StreamRecord], float | None]:
    """Stream every request at once; when ``fault_after_streams`` streams have at least
    ``fault_after_tokens`` tokens, run ``fault`` (in a thread; a coroutine function runs on
    this loop instead, e.g. to start a process that must outlive the threads of the loop's
    pool). Returns (records, fault time)."""

    records = [StreamRecord(r.request_id) for r in requests]
    fault_at = None
    async with AsyncPdserveClient(target) as client:
        tasks = [asyncio.create_task(stream_one(client, r, rec, timeout))
                 for r, rec in zip(requests, records, strict=True)]
        if fault is not None:
            while sum(len(r.token_ids) >= fault_after_tokens for r in records) \
                    < fault_after_streams and not all(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            fault_at = time.monotonic()
            if asyncio.iscoroutinefunction(fault):
                await fault()
            else:
                await asyncio.to_thread(fault)
        await asyncio.gather(*tasks)
    return records, fault_at


def busiest(cluster, role: str) -> str:
    """The worker of ``role`` running the most requests now."""
    stats = [s for s in cluster.worker_stats().values() if s.role == role]
    return max(stats, key=lambda s: (s.num_running + s.num_waiting, s.worker_id)).worker_id


def sigkill_busiest(cluster, role: str = "decode") -> Callable[[], None]:
    return lambda: cluster.kill_worker_process(busiest(cluster, role), signal.SIGKILL)


def resume_gaps(record: StreamRecord, fault_at: float) -> float | None:
    """Seconds from the fault to the stream's resumed token: the chunk that ends the longest
    silence after the fault (chunks already in flight at the kill arrive before it)."""
    after = [t for t in record.chunk_times if t > fault_at]
    if not after:
        return None
    edges = [fault_at, *after]
    gaps = [(b - a, b) for a, b in zip(edges, edges[1:], strict=False)]
    return max(gaps)[1] - fault_at


def run(num_requests: int, model: str | None, seed: int) -> str:
    # no prefix cache: the faulted pass would find the fault-free pass's prompts cached (the
    # re-prefill of a migration is then measured without the cache's help: the worst case)
    options = ClusterOptions(model=model, num_prefill=1, num_decode=2, port=0,
                             metrics_port=None, router=RouterConfig(stats_interval_s=0.1),
                             engine=dict(dtype="float32", memory_budget_bytes=512 << 20,
                                         enable_prefix_caching=False))
    with EmbeddedCluster(options) as cluster:
        cluster.wait_ready(120)
        reqs = chaos_requests(num_requests, seed, prefix="clean")
        clean, _ = asyncio.run(stream_all(cluster.target, reqs))
        faulty_reqs = chaos_requests(num_requests, seed, prefix="kill")
        faulty, fault_at = asyncio.run(stream_all(cluster.target, faulty_reqs,
                                                  sigkill_busiest(cluster)))
        cluster.wait_pools(120)
        back_s = time.monotonic() - fault_at  # an upper bound: checked after the streams
        traces = {t.request_id: t for t in cluster.traces()}
    return report(clean, faulty, fault_at, traces, back_s)


def report(clean: list[StreamRecord], faulty: list[StreamRecord], fault_at: float,
           traces: dict, back_s: float) -> str:
    """The printed figures (see the module docstring)."""
    same = sum(a.token_ids == b.token_ids for a, b in zip(clean, faulty, strict=True))
    failed = [r.request_id for r in faulty if r.error]
    migrated = [(c, f) for c, f in zip(clean, faulty, strict=True)
                if traces.get(f.request_id) and traces[f.request_id].num_migrations]
    gaps = [g for _, f in migrated if (g := resume_gaps(f, fault_at)) is not None]
    extra = [f.e2e - c.e2e for c, f in migrated]
    rows = [("kill -> first resumed token (s)", *_quantiles(gaps)),
            ("extra e2e of migrated requests (s)", *_quantiles(extra)),
            ("e2e of the same requests fault-free (s)", *_quantiles([c.e2e for c, _ in migrated]))]
    lines = [f"{len(faulty)} streams, {len(migrated)} migrated, {len(failed)} failed, "
             f"{same}/{len(faulty)} token-identical to the fault-free pass",
             format_table(["", "P50", "P99", "n"], rows),
             f"decode pool back at its target size within {back_s:.1f} s of the kill "
             "(checked once the streams had ended)"]
    return "\n".join(lines)


def _quantiles(values: list[float]) -> tuple[str, str, str]:
    if not values:
        return "-", "-", "0"
    s = summarize(values)
    return f"{s['p50']:.3f}", f"{s['p99']:.3f}", str(len(values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(run(args.requests, args.model, args.seed))


if __name__ == "__main__":
    main()
