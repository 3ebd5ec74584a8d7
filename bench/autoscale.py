"""``python -m pdserve.bench.autoscale``: what autoscaling buys on a step load.

One run, one local Ray, the built-in tiny model (or ``--model``), three setups in turn on the
same seeded trace:

* static 1P+1D, static 2P+2D, and autoscaled (1..2 prefill, 1..2 decode, tight delays);
* the trace is a step load: Poisson arrivals at ``--low-rate`` for the first phase,
  ``--high-rate`` for the second, ``--low-rate`` again for the third (``--phase-s``), with
  long-tailed prompt and output lengths; every request streams through gRPC;
* decode workers hold ``--max-num-seqs`` sequences each, so a pool's capacity is its batch
  slots and KV as much as its share of the cores (on a 2-core machine the four workers of
  2P+2D share two cores: what a second worker adds is room, not FLOPs).

SLOs: ``--ttft-slo-ms`` / ``--itl-slo-ms``, or by default 3x the P90 TTFT and P90 gap between
tokens that static 1P+1D measured in its first (low) phase; the autoscaler runs against the
same SLOs (its ITL signal is the P90 gap, a request's attainment its mean time per output
token). Each setup is warmed up (two requests per worker, one at a time: no burst for the
autoscaler to answer) and left idle one autoscaler window before the trace; a worker the
autoscaler starts mid-trace is not warmed: its first requests are part of the cost.
Printed per setup and phase: P99 TTFT, P99 ITL, SLO attainment (a request meets its SLOs
when its TTFT and its mean inter-token time are both within them; a failed request does
not), and the worker-seconds the pools held (starting, ready and draining workers, sampled
twice a second). The PNG (``--out``) draws the load and every setup's pool sizes over time.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

from pdserve.api.client import AsyncPdserveClient, PdserveError
from pdserve.bench.stats import format_table, lognormal_lengths, percentile
from pdserve.cluster.autoscale.config import AutoscaleConfig
from pdserve.cluster.launcher import EmbeddedCluster
from pdserve.cluster.options import ClusterOptions
from pdserve.cluster.ray_env import init_ray
from pdserve.router.core import RouterConfig

logger = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
WINDOW_S = 8.0  # the autoscaled setup's window (and the idle time before each trace)


@dataclass(frozen=True)
class Request:
    arrival_s: float  # from the trace start
    phase: int  # index of its phase
    prompt: list[int]  # token ids
    max_tokens: int


@dataclass
class Record:
    """One request as the client saw it (monotonic seconds from the trace start)."""

    request: Request
    first_s: float | None = None  # first token
    end_s: float | None = None
    num_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds between tokens
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.request.arrival_s

    @property
    def tpot(self) -> float | None:
        if self.first_s is None or self.end_s is None or self.num_tokens < 2:
            return None
        return (self.end_s - self.first_s) / (self.num_tokens - 1)


@dataclass
class SetupRun:
    name: str
    records: list[Record]
    samples: list[tuple[float, dict[str, int]]]  # (seconds from start, role -> workers held)
    duration_s: float

    def worker_seconds(self) -> float:
        total = 0.0
        for (t0, held), (t1, _) in zip(self.samples, self.samples[1:], strict=False):
            total += sum(held.values()) * (t1 - t0)
        return total


def step_trace(low: float, high: float, phases_s: tuple[float, float, float], seed: int,
               prompt_mean: int = 96, output_mean: int = 128,
               vocab: int = 480) -> list[Request]:
    """Poisson arrivals at low, high, low rate over the three phases; log-normal lengths."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for phase, (rate, duration) in enumerate(zip((low, high, low), phases_s, strict=True)):
        t = start + rng.expovariate(rate)
        while t < start + duration:
            out.append((t, phase))
            t += rng.expovariate(rate)
        start += duration
    prompts = lognormal_lengths(rng, len(out), mean=prompt_mean, low=8, high=512)
    outputs = lognormal_lengths(rng, len(out), mean=output_mean, low=4, high=512)
    return [Request(t, phase, [rng.randrange(3, vocab) for _ in range(n_in)], n_out)
            for (t, phase), n_in, n_out in zip(out, prompts, outputs, strict=True)]


async def _one(client, record: Record, t0: float) -> None:
    request = record.request
    await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.monotonic()))
    last = None
    try:
        async for chunk in client.generate_stream(request.prompt, max_tokens=request.max_tokens,
                                                  temperature=0.0, ignore_eos=True,
                                                  timeout=300):
            n = len(chunk.token_ids)
            if not n:
                continue
            now = time.monotonic() - t0
            if record.first_s is None:
                record.first_s = now
            else:
                record.gaps += [(now - last) / n] * n
            last = now
            record.num_tokens += n
    except PdserveError as exc:
        record.error = exc.code.name
    record.end_s = time.monotonic() - t0


async def drive(target: str, trace: list[Request], t0: float) -> list[Record]:
    """Send every request at its arrival time (open loop); returns the records."""

    records = [Record(r) for r in trace]
    async with AsyncPdserveClient(target) as client:
        await asyncio.gather(*(_one(client, rec, t0) for rec in records))
    return records


class PoolSampler(threading.Thread):
    """Samples the pools (workers held per role) twice a second while the trace runs."""

    def __init__(self, cluster, t0: float, period_s: float = 0.5):
        super().__init__(daemon=True)
        self.cluster, self.t0, self.period_s = cluster, t0, period_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.done = threading.Event()

    def sample(self) -> None:
        pools = self.cluster._ray.get(self.cluster.router.pools_info.remote(), timeout=30)
        self.samples.append((time.monotonic() - self.t0,
                             {p.role: p.actual + p.draining for p in pools}))

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - a missed sample, not a failed run
                logger.warning("pool sample failed: %s", exc)
            self.done.wait(self.period_s)


def cluster_options(args, num_prefill: int, num_decode: int,
                    slos: dict[str, float] | None = None):
    """One setup's ClusterOptions; with ``slos``, autoscaled 1..2 per pool against them."""

    engine = dict(dtype="float32", memory_budget_bytes=512 << 20, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=64)
    auto = AutoscaleConfig()
    if slos is not None:
        auto = AutoscaleConfig(
            enabled=True, min_prefill=1, max_prefill=2, min_decode=1, max_decode=2,
            scale_interval_s=2.0, scale_up_delay_s=3.0, scale_down_delay_s=8.0,
            scale_down_grace_s=8.0, window_s=WINDOW_S, ttft_slo_ms=slos["ttft"] * 1000,
            itl_slo_ms=slos["itl"] * 1000, prefill_queue_up_tokens=512,
            prefill_queue_down_tokens=64)
    return ClusterOptions(model=args.model, num_prefill=num_prefill, num_decode=num_decode,
                          port=0, metrics_port=None, engine=engine,
                          router=RouterConfig(stats_interval_s=0.1), heartbeat_s=0.5,
                          ttl_s=3.0, autoscale=auto)


def run_setup(name: str, options, trace: list[Request]) -> SetupRun:
    with EmbeddedCluster(options) as cluster:
        cluster.wait_ready(120)
        for i in range(2 * (options.num_prefill + options.num_decode)):
            asyncio.run(drive(cluster.target, [Request(0.0, -1, [5 + i, 6, 7, 8] * 8, 8)],
                              time.monotonic()))
        time.sleep(WINDOW_S)  # the warm-up leaves the autoscaler's window before the trace
        t0 = time.monotonic()
        sampler = PoolSampler(cluster, t0)
        sampler.sample()
        sampler.start()
        records = asyncio.run(drive(cluster.target, trace, t0))
        sampler.done.set()
        sampler.join(10)
        duration = time.monotonic() - t0
    logger.info("%s: %d requests in %.1f s", name, len(records), duration)
    return SetupRun(name, records, sampler.samples, duration)


def derive_slos(run: SetupRun) -> dict[str, float]:
    """3x the first (low) phase's P90 TTFT and P90 inter-token gap: what an unloaded 1P+1D
    serves, with room for this machine's noise."""
    low = [r for r in run.records if r.request.phase == 0 and r.error is None]
    ttfts = [r.ttft for r in low if r.ttft is not None]
    gaps = [g for r in low for g in r.gaps]
    return {"ttft": 3 * percentile(ttfts, 90), "itl": 3 * percentile(gaps, 90)}


def meets(record: Record, slos: dict[str, float]) -> bool:
    if record.error is not None or record.ttft is None:
        return False
    tpot = record.tpot
    return record.ttft <= slos["ttft"] and (tpot is None or tpot <= slos["itl"])


def table(runs: list[SetupRun], slos: dict[str, float], phase_names: list[str]) -> str:
    rows = []
    for run in runs:
        for phase, name in enumerate(phase_names):
            recs = [r for r in run.records if r.request.phase == phase]
            ttfts = [r.ttft for r in recs if r.ttft is not None]
            gaps = [g for r in recs for g in r.gaps]
            rows.append([run.name, name, len(recs), sum(r.error is not None for r in recs),
                         percentile(ttfts, 99) * 1000, percentile(gaps, 99) * 1000,
                         f"{sum(meets(r, slos) for r in recs) / max(1, len(recs)):.1%}"])
        recs = run.records
        rows.append([run.name, "all", len(recs), sum(r.error is not None for r in recs),
                     percentile([r.ttft for r in recs if r.ttft is not None], 99) * 1000,
                     percentile([g for r in recs for g in r.gaps], 99) * 1000,
                     f"{sum(meets(r, slos) for r in recs) / max(1, len(recs)):.1%}"])
    return format_table(["setup", "window", "requests", "failed", "P99 TTFT ms", "P99 ITL ms",
                         "SLO attainment"], rows)


def summary(runs: list[SetupRun], slos: dict[str, float]) -> str:
    rows = []
    for run in runs:
        attained = sum(meets(r, slos) for r in run.records) / max(1, len(run.records))
        rows.append([run.name, f"{attained:.1%}", run.worker_seconds(),
                     max((sum(h.values()) for _, h in run.samples), default=0)])
    lines = [format_table(["setup", "SLO attainment", "worker-seconds", "max workers"], rows)]
    by_name = {r.name: r for r in runs}
    small, big, auto = (by_name.get(n) for n in ("static 1P+1D", "static 2P+2D",
                                                 "autoscaled 1..2"))
    if small and big and auto:
        att = {r.name: sum(meets(x, slos) for x in r.records) / max(1, len(r.records))
               for r in runs}
        lines.append(
            f"autoscaled: {att[auto.name]:.1%} attainment vs {att[big.name]:.1%} (2P+2D) and "
            f"{att[small.name]:.1%} (1P+1D), using {auto.worker_seconds():.0f} worker-seconds "
            f"= {auto.worker_seconds() / big.worker_seconds():.2f}x 2P+2D's, "
            f"{auto.worker_seconds() / small.worker_seconds():.2f}x 1P+1D's")
    return "\n".join(lines)


def plot(runs: list[SetupRun], trace: list[Request], phases_s, path: str) -> str:
    # lazy: plots only when asked; matplotlib takes a second to import
    import matplotlib

    matplotlib.use("Agg")
    # lazy: plots only when asked; matplotlib takes a second to import
    import matplotlib.pyplot as plt

    end = max([sum(phases_s), *(r.duration_s for r in runs)])
    fig, axes = plt.subplots(1 + len(runs), 1, figsize=(8, 2 + 1.6 * len(runs)), sharex=True)
    load_ax, pool_axes = axes[0], axes[1:]
    bins = [i * 2.0 for i in range(int(sum(phases_s) / 2) + 1)]
    load_ax.hist([r.arrival_s for r in trace], bins=bins, weights=[0.5] * len(trace),
                 color="tab:gray")
    load_ax.set_ylabel("arrivals / s")
    load_ax.set_title("step load, and the workers each setup held")
    for ax, run in zip(pool_axes, runs, strict=True):
        times = [t for t, _ in run.samples]
        for role, color, offset in (("prefill", "tab:blue", 0.03), ("decode", "tab:red", -0.03)):
            ax.step(times, [h.get(role, 0) + offset for _, h in run.samples], where="post",
                    color=color, label=role)
        ax.set_ylim(0.5, 2.5)
        ax.set_yticks([1, 2])
        ax.set_ylabel("workers")
        ax.set_title(f"{run.name}: {run.worker_seconds():.0f} worker-seconds", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    pool_axes[-1].set_xlabel("seconds from the trace start")
    pool_axes[-1].set_xlim(0, end)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--low-rate", type=float, default=1.0, help="requests/s, low phases")
    parser.add_argument("--high-rate", type=float, default=3.0, help="requests/s, high phase")
    parser.add_argument("--phase-s", default="30,90,60",
                        help="low,high,low phase durations in seconds")
    parser.add_argument("--prompt-mean", type=int, default=96, help="mean prompt tokens")
    parser.add_argument("--output-mean", type=int, default=128, help="mean output tokens")
    parser.add_argument("--max-num-seqs", type=int, default=1,
                        help="sequences per worker step (each decode worker's batch slots)")
    parser.add_argument("--ttft-slo-ms", type=float, default=None,
                        help="default: 3x static 1P+1D's low-phase P90 TTFT")
    parser.add_argument("--itl-slo-ms", type=float, default=None,
                        help="default: 3x static 1P+1D's low-phase P90 gap between tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="autoscale.png", help="the PNG's path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger(__name__).setLevel(logging.INFO)
    phases_s = tuple(float(x) for x in args.phase_s.split(","))
    if len(phases_s) != 3:
        parser.error("--phase-s takes three durations: low,high,low")


    temp_dir = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")
    ray = init_ray(temp_dir=temp_dir, num_cpus=16)  # logical: the pools share the cores
    trace = step_trace(args.low_rate, args.high_rate, phases_s, args.seed, args.prompt_mean,
                       args.output_mean)
    try:
        runs = [run_setup("static 1P+1D", cluster_options(args, 1, 1), trace)]
        slos = derive_slos(runs[0])  # the autoscaler runs against the SLOs we score with
        if args.ttft_slo_ms is not None:
            slos["ttft"] = args.ttft_slo_ms / 1000
        if args.itl_slo_ms is not None:
            slos["itl"] = args.itl_slo_ms / 1000
        runs.append(run_setup("static 2P+2D", cluster_options(args, 2, 2), trace))
        runs.append(run_setup("autoscaled 1..2", cluster_options(args, 1, 1, slos), trace))
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    phases = ["low", "high", "low again"]
    print(f"{len(trace)} requests: {args.low_rate:g} req/s for {phases_s[0]:g} s, "
          f"{args.high_rate:g} req/s for {phases_s[1]:g} s, {args.low_rate:g} req/s for "
          f"{phases_s[2]:g} s; SLOs: TTFT {slos['ttft'] * 1000:.0f} ms, ITL "
          f"{slos['itl'] * 1000:.1f} ms")
    print(table(runs, slos, phases))
    print()
    print(summary(runs, slos))
    print(f"plot: {plot(runs, trace, phases_s, args.out)}")


if __name__ == "__main__":
    main()
