"""``pdserve demo``: the embedded cluster under real concurrent gRPC traffic, then a report.

1. Start the embedded cluster (default: 1 prefill + 1 decode worker on the built-in tiny model,
   a 512 MiB memory budget per worker) on free ports, wait for SERVING.
2. Send ``num_requests`` text prompts with long-tailed prompt and output lengths through the
   async client, ``concurrency`` at a time, with a progress bar; the client times TTFT and TPOT.
3. Read the router's traces (queue, prefill, transfer, decode per request) and each worker's
   stats (memory ledger), stop the cluster, and return a :class:`DemoReport`;
   :func:`format_report` turns it into the printed tables.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from pdserve.api.client import AsyncPdserveClient
from pdserve.bench.phases import (
    PHASES,
    format_prefill_locations,
    phase_seconds,
    prefill_locations,
)
from pdserve.bench.stats import format_table, summarize
from pdserve.cli.offline_demo import make_prompts
from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster

logger = logging.getLogger(__name__)

DEMO_MEMORY_BUDGET = 512 << 20  # bytes per worker: weights + activations + KV pool
MiB = 1 << 20


@dataclass
class ClientTiming:
    """One request as the client saw it."""

    ttft: float  # call start -> first chunk with tokens (s)
    e2e: float  # call start -> last chunk (s)
    num_tokens: int  # tokens received

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_tokens - 1)


@dataclass
class DemoReport:
    """What the demo measured."""

    description: str  # cluster shape and model
    wall_s: float  # traffic start -> last response
    concurrency: int  # requests in flight at most
    timings: list[ClientTiming] = field(default_factory=list)
    traces: list = field(default_factory=list)  # the router's RequestTrace per request
    worker_stats: dict = field(default_factory=dict)  # worker_id -> WorkerStats
    sample: str = ""  # the first request's text
    builtin_model: bool = True  # served the built-in tiny model (random weights)


async def fit_to_context(client: AsyncPdserveClient, prompt: str, max_tokens: int,
                         context: int) -> tuple[list[int], int]:
    """The prompt's ids and max_tokens cut to fit the served model's context (any checkpoint:
    outputs to at most half of it, the prompt to the rest)."""
    max_tokens = max(1, min(max_tokens, context // 2))
    ids = await client.tokenize(prompt)
    return ids[:max(1, context - max_tokens)], max_tokens


async def _one(client: AsyncPdserveClient, prompt: str, max_tokens: int, seed: int,
               gate: asyncio.Semaphore, progress, context: int) -> tuple[ClientTiming, str]:
    async with gate:
        prompt, max_tokens = await fit_to_context(client, prompt, max_tokens, context)
        start = time.perf_counter()
        ttft, n, texts = None, 0, []
        async for chunk in client.generate_stream(prompt, max_tokens=max_tokens,
                                                  temperature=0.8, top_p=0.95, seed=seed,
                                                  ignore_eos=True):
            if chunk.token_ids and ttft is None:
                ttft = time.perf_counter() - start
            n += len(chunk.token_ids)
            texts.append(chunk.text)
        end = time.perf_counter() - start
        progress.update(1)
        return ClientTiming(ttft if ttft is not None else end, end, n), "".join(texts)


async def drive(target: str, prompts: list[str], output_lens: list[int],
                concurrency: int, api_key: str | None = None
                ) -> tuple[list[ClientTiming], str]:
    """Send every prompt through gRPC (with the cluster's ``api_key``, if any),
    ``concurrency`` at a time, with a progress bar."""

    gate = asyncio.Semaphore(concurrency)
    with tqdm(total=len(prompts), desc="requests", unit="req") as progress:
        async with AsyncPdserveClient(target, api_key=api_key) as client:
            context = (await client.model_info(timeout=30)).max_context_tokens
            done = await asyncio.gather(*(
                _one(client, p, m, i, gate, progress, context)
                for i, (p, m) in enumerate(zip(prompts, output_lens, strict=True))))
    return [t for t, _ in done], done[0][1] if done else ""


def demo_options() -> ClusterOptions:
    """The demo's cluster when no flag says otherwise: free gRPC port, no metrics port, a
    ``DEMO_MEMORY_BUDGET`` per worker (``pdserve demo`` flags override these like any other)."""
    return ClusterOptions(port=0, metrics_port=None,
                          engine=dict(memory_budget_bytes=DEMO_MEMORY_BUDGET))


def run_demo(num_requests: int = 48, concurrency: int = 8, seed: int = 0,
             options: ClusterOptions | None = None) -> DemoReport:
    """Steps 1-3 of the module docstring on ``options`` (default :func:`demo_options`)."""
    options = options or demo_options()
    rng = random.Random(seed)
    prompts, output_lens = make_prompts(rng, num_requests)
    shape = (f"{options.num_decode} colocated" if options.colocated
             else f"{options.num_prefill} prefill + {options.num_decode} decode")
    with EmbeddedCluster(options) as cluster:
        cluster.wait_ready(120)
        logger.info("demo cluster serving on %s", cluster.target)
        start = time.perf_counter()
        timings, sample = asyncio.run(drive(cluster.target, prompts, output_lens,
                                            concurrency, cluster.options.api_key))
        wall = time.perf_counter() - start
        report = DemoReport(f"{shape} worker(s) on {cluster.model}", wall, concurrency,
                            timings, cluster.traces(), cluster.worker_stats(), sample,
                            builtin_model=options.model is None)
    return report


def _ms_rows(series: list[tuple[str, list[float]]]) -> list[list]:
    return [[name] + [v * 1000 for v in summarize(values).values()] for name, values in series]


def format_report(report: DemoReport) -> str:
    """The demo's printed output: latencies, time split, memory ledger per worker."""
    timings, traces = report.timings, report.traces
    generated = sum(t.num_tokens for t in timings)
    lines = [f"\n{report.description}",
             f"{len(timings)} requests ({report.concurrency} concurrent), {generated} tokens "
             f"in {report.wall_s:.2f} s ({generated / max(report.wall_s, 1e-9):,.0f} tok/s)\n",
             "latency seen by the client (ms)"]
    lines.append(format_table(["", "mean", "P50", "P90", "P99"], _ms_rows([
        ("TTFT", [t.ttft for t in timings]),
        ("TPOT", [t.tpot for t in timings if t.tpot is not None]),
        ("e2e", [t.e2e for t in timings])])))
    lines.append("\nwhere the time went, per request (router traces, ms; router = the part of "
                 "TTFT no worker timed: admission, placing, RPCs)")
    split = [phase_seconds(t) for t in traces]
    phases = [(name, [p[name] for p in split]) for name in PHASES]
    phases += [(name, [getattr(t, name) for t in traces]) for name in ("ttft", "e2e")]
    rows = [[name, summarize(v)["mean"] * 1000, summarize(v)["p50"] * 1000,
             summarize(v)["p99"] * 1000] for name, v in phases]
    lines.append(format_table(["phase", "mean", "P50", "P99"], rows))
    locations = prefill_locations(traces)
    if locations:
        lines.append(format_prefill_locations(locations))
    lines.append("\nmemory ledger per worker")
    lines.append(format_table(
        ["worker", "role", "weights MiB", "activations MiB", "KV pool MiB", "KV blocks",
         "block size", "KV B/token", "KV tokens", "used blocks"],
        [_ledger_row(wid, s) for wid, s in sorted(report.worker_stats.items())]))
    lines += [f"{wid}: int8 KV {s.ledger['kv_int8']}"
              for wid, s in sorted(report.worker_stats.items()) if s.ledger.get("kv_int8")]
    label = "random weights, gibberish" if report.builtin_model else "sampled, temperature 0.8"
    lines.append(f"\nsample output ({label}): {report.sample[:80]!r}")
    return "\n".join(lines)


def _ledger_row(worker_id: str, stats) -> list:
    ledger = stats.ledger
    return [worker_id, stats.role, ledger.get("weight_bytes", 0) / MiB,
            ledger.get("activation_bytes", 0) / MiB, ledger.get("kv_pool_bytes", 0) / MiB,
            ledger.get("num_kv_blocks", stats.total_blocks), ledger.get("block_size", "?"),
            ledger.get("kv_bytes_per_token", "?"), ledger.get("kv_token_capacity", "?"),
            stats.used_blocks]
