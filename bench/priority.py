"""``python -m pdserve.bench.priority``: what priority scheduling buys, measured in one run.

Real router and real workers (1 prefill + 1 decode, the built-in tiny model or ``--model``) in
this process, so the figures isolate scheduling from transport:

1. **Flood.** A burst of low-priority requests (priority 5) fills the decode pool; high-priority
   ones (priority 0) arrive during it. Their TTFT P50/P99 under ``fcfs`` and ``priority``.
2. **Storm.** A stream of normal requests, with and without one request whose context fills
   most of the decode pool: the normal requests' throughput (tokens/s over their own span),
   under ``fcfs``, ``priority`` (the big one, low priority, is bounced back to the prefill
   pool when the pool runs short) and ``priority`` with a context cap
   (``max_request_kv_fraction`` 0.5, which refuses the big one at admission), and the decode
   pool's preemptions (the last run of each setup). Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

from pdserve import SamplingParams
from pdserve.bench.stats import format_table, percentile, summarize
from pdserve.engine.config import EngineConfig
from pdserve.models import tiny_model_dir
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.core import Router, RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.workers.build import build_local_workers

logger = logging.getLogger(__name__)

DECODE_BLOCKS = 64  # 256 tokens of KV at block size 4: the pool the scenarios overload


@dataclass
class Outcome:
    """One request as the bench saw it."""

    ttft: float | None  # seconds to the first token (None: failed before one)
    end: float  # time.monotonic() of its end
    start: float
    num_tokens: int
    error: str | None = None


async def _one(router, request_id: str, prompt: list[int], params) -> Outcome:
    start, first, tokens = time.monotonic(), None, 0
    try:
        async for delta in router.generate(PreparedRequest(request_id, prompt, params,
                                                       params.max_tokens)):
            if delta.token_ids and first is None:
                first = time.monotonic() - start
            tokens += len(delta.token_ids)
    except Exception as exc:  # noqa: BLE001 - refused or failed: reported, not raised
        return Outcome(first, time.monotonic(), start, tokens, type(exc).__name__)
    return Outcome(first, time.monotonic(), start, tokens)


async def _cluster(model: str, policy: str, **router_kw):
    config = EngineConfig(model=model, dtype="float32", block_size=4, num_kv_blocks=DECODE_BLOCKS,
                          max_num_batched_tokens=64, scheduling_policy=policy)
    handles = build_local_workers(config, num_prefill=1, num_decode=1)
    router = Router(ModelSpec("bench", 2048, 512), StaticDirectory(handles), tokenize=list,
                    config=RouterConfig(stats_interval_s=0.05, scheduling_policy=policy,
                                        **router_kw))
    await router.start()
    return handles, router


async def _close(handles, router) -> None:
    await router.stop()
    for h in handles:
        h.close()


async def flood(model: str, policy: str) -> list[float]:
    """High-priority TTFTs while a low-priority burst holds the pool."""

    handles, router = await _cluster(model, policy)
    try:
        low = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, priority=5)
        high = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, priority=0)
        tasks = [asyncio.create_task(_one(router, f"low{i}", [5 + i % 90] * 24, low))
                 for i in range(32)]
        await asyncio.sleep(0.05)
        highs = []
        for i in range(8):
            highs.append(asyncio.create_task(_one(router, f"high{i}", [200 + i] * 12, high)))
            await asyncio.sleep(0.02)
        high_out = await asyncio.gather(*highs)
        await asyncio.gather(*tasks)
        return [o.ttft for o in high_out if o.ttft is not None]
    finally:
        await _close(handles, router)


async def storm(model: str, policy: str, with_big: bool, **router_kw):
    """(normal tokens/s, normal failures, decode preemptions, the big one's outcome)."""

    handles, router = await _cluster(model, policy, **router_kw)
    try:
        normal = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        big_task = None
        if with_big:
            big = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, priority=5)
            big_task = asyncio.create_task(_one(router, "big", [7] * 180, big))
            await asyncio.sleep(0.05)
        tasks = []
        for i in range(24):
            tasks.append(asyncio.create_task(_one(router, f"n{i}", [9 + i] * 16, normal)))
            await asyncio.sleep(0.01)
        outs = await asyncio.gather(*tasks)
        big_out = await big_task if big_task is not None else None
        span = max(o.end for o in outs) - min(o.start for o in outs)
        decode = next(h.worker for h in handles if h.role == "decode")
        preemptions = decode.engine.scheduler.num_preemptions
        failed = sum(o.error is not None for o in outs)
        return sum(o.num_tokens for o in outs) / span, failed, preemptions, big_out
    finally:
        await _close(handles, router)


def run(model: str | None, repeats: int = 3) -> str:
    model = model or str(tiny_model_dir())
    lines = ["Flood: 32 low-priority requests, 8 high-priority ones arriving during it"]
    rows = []
    for policy in ("fcfs", "priority"):
        s = summarize(asyncio.run(flood(model, policy)))
        rows.append((policy, f"{s['p50'] * 1e3:.0f}", f"{s['p99'] * 1e3:.0f}"))
    ratio = float(rows[0][2]) / max(1.0, float(rows[1][2]))
    lines += [format_table(["policy", "high TTFT P50 (ms)", "high TTFT P99 (ms)"], rows),
              f"high-priority TTFT P99: fcfs / priority = {ratio:.2f}x", "",
              "Storm: 24 normal requests, with and without one ~60-block context "
              f"(decode pool {DECODE_BLOCKS} blocks)"]
    rows = []
    setups = [("fcfs", {}), ("priority", {}),
              ("priority + cap 0.5", dict(max_request_kv_fraction=0.5))]
    for name, kw in setups:
        policy = name.split()[0]
        alone, with_big = [], []
        for _ in range(repeats):  # interleaved, medians: this machine's speed drifts
            alone.append(asyncio.run(storm(model, policy, False, **kw))[0])
            tput, failed, preempt, big = asyncio.run(storm(model, policy, True, **kw))
            with_big.append(tput)
        base, tput = percentile(alone, 50), percentile(with_big, 50)
        rows.append((name, f"{base:.0f}", f"{tput:.0f}", f"{tput / base:.2f}", failed, preempt,
                     big.error or "completed"))
    lines.append(format_table(["setup", "normal tok/s alone", "with big", "ratio",
                               "normal failed", "decode preemptions", "big request"], rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--repeats", type=int, default=3, help="storm runs per setup (median)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    print(run(args.model, args.repeats))


if __name__ == "__main__":
    main()
