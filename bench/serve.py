"""``pdserve bench serve``: load a running server with a seeded trace and report what it did.

1. Wait for health SERVING (``wait_ready_s``), read the model's context and vocabulary.
2. Build the trace (:mod:`pdserve.bench.workload`): prompts and output lengths, arrival times
   (``request_rate``, ``burstiness``), and send each request at its time over gRPC (or the
   OpenAI HTTP API with ``base_url``: :mod:`pdserve.bench.http_client`), at most
   ``max_concurrency`` in flight (a request's clock starts when it is sent, as in vLLM), with
   a progress bar. Each is sent greedy with ``ignore_eos``, so it generates ``output_len``.
   With several gRPC targets (routers of one cluster), request ``i`` goes to target
   ``i mod n``, as a load balancer without session affinity would send it.
3. Meanwhile sample the workers (Admin ``ListWorkers``) once a second: what binds each one.
4. Afterwards read the server's side (Admin ``GetTraces`` for these request ids from every
   target that serves Admin, workers' memory ledgers, ``GetConfig``); a server without the
   Admin service still gets a result.
5. :func:`compute_metrics` turns the client's timings into the result keys of vLLM's
   ``bench serve`` (``duration``, ``completed``, ``request_goodput``, ``mean_ttft_ms``,
   ``p99_itl_ms``, ...), so scripts written against it read these too; pdserve adds
   ``failed``, ``phases`` (the per-phase split of the router traces), ``workers`` and
   ``server_config``.

Metric definitions (vLLM's): TTFT = send -> first chunk with tokens; ITL = the gaps between
later chunks (every request's, pooled); TPOT = (e2e - TTFT) / (output tokens - 1), requests
with one token left out; E2EL = send -> last chunk. A request is "good" when it meets every
``--goodput`` SLO (ttft, tpot, e2el in ms); ``request_goodput`` is good requests per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import math
import time
import uuid
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from pdserve.api.admin_client import AdminClient, trace_dict
from pdserve.api.client import AsyncPdserveClient, PdserveError
from pdserve.bench.http_client import HttpCompletions
from pdserve.bench.phases import phase_split, prefill_locations
from pdserve.bench.stats import percentile
from pdserve.bench.workload import (
    DATASETS,
    BenchRequest,
    RequestOutcome,
    SyntheticShape,
    arrival_times,
    jsonl_requests,
    prefix_requests,
    synthetic_requests,
)

logger = logging.getLogger(__name__)

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class ServeOptions:
    """What ``pdserve bench serve`` is asked for (its flags)."""

    target: str = "127.0.0.1:50051"  # gRPC HOST:PORT, or a comma list of one cluster's
    # routers that the requests are spread over (the first gives the model info and workers)
    base_url: str | None = None  # send the traffic over OpenAI HTTP here instead of gRPC
    wait_ready_s: float = 0.0  # wait this long for health SERVING (0: check once)
    num_prompts: int = 200
    request_rate: float = math.inf  # requests/s; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the gaps (1 = Poisson)
    max_concurrency: int | None = None  # requests in flight at most
    seed: int = 0
    dataset: str = "synthetic"  # synthetic | prefix | jsonl
    dataset_path: str | None = None  # the jsonl file
    shape: SyntheticShape = field(default_factory=SyntheticShape)
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms
    percentile_metrics: tuple[str, ...] = METRICS
    metric_percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    timeout_s: float = 600.0  # one request's deadline
    api_key: str | None = None  # the server's inference key
    admin_api_key: str | None = None  # its admin key: traces, workers and config (Admin)
    tls: object | None = None  # api.client.ClientTLS
    disable_tqdm: bool = False
    progress_desc: str = "requests"  # the progress bar's label

    def __post_init__(self) -> None:
        bad = set(self.goodput) - set(GOODPUT_METRICS)
        if bad:
            raise ValueError(f"goodput metrics must be among {', '.join(GOODPUT_METRICS)}; "
                             f"got {', '.join(sorted(bad))}")
        if any(not v > 0 for v in self.goodput.values()):
            raise ValueError("goodput SLOs must be > 0 ms")
        bad = set(self.percentile_metrics) - set(METRICS)
        if bad:
            raise ValueError(f"percentile_metrics must be among {', '.join(METRICS)}; "
                             f"got {', '.join(sorted(bad))}")
        if any(not 0 <= p <= 100 for p in self.metric_percentiles):
            raise ValueError("metric_percentiles must be in [0, 100]")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, "
                             f"got {self.dataset!r}")
        if self.dataset == "jsonl" and not self.dataset_path:
            raise ValueError("dataset jsonl needs dataset_path")
        arrival_times(0, self.request_rate, self.burstiness)  # validates both
        if not all(self.targets):
            raise ValueError(f"target must be HOST:PORT or a comma list of them, "
                             f"got {self.target!r}")
        if self.base_url is not None and len(self.targets) > 1:
            raise ValueError("several targets spread gRPC traffic; with base_url give one")

    @property
    def targets(self) -> list[str]:
        return [t.strip() for t in self.target.split(",")]


def build_requests(opts: ServeOptions, vocab_size: int, max_context: int) -> list[BenchRequest]:
    if opts.dataset == "jsonl":
        return jsonl_requests(opts.dataset_path, opts.num_prompts, opts.seed, vocab_size,
                              max_context, opts.shape)
    if opts.dataset == "prefix":
        return prefix_requests(opts.num_prompts, opts.seed, vocab_size, max_context,
                               opts.shape)
    return synthetic_requests(opts.num_prompts, opts.seed, vocab_size, max_context, opts.shape)


async def send_one(client, request: BenchRequest, request_id: str, t0: float,
                   timeout: float) -> RequestOutcome:
    out = RequestOutcome(request_id, request.prompt_len)
    start = time.perf_counter()
    out.start = start - t0
    last = None
    try:
        async for chunk in client.generate_stream(
                request.prompt, request_id=request_id, timeout=timeout,
                max_tokens=request.output_len, temperature=0.0, ignore_eos=True):
            now = time.perf_counter()
            if chunk.token_ids:
                if last is None:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                out.output_len += len(chunk.token_ids)
            if chunk.usage is not None:
                out.prompt_len = chunk.usage.prompt_tokens
        out.e2el = time.perf_counter() - start
        out.success = out.output_len > 0
        out.error = "" if out.success else "no tokens"
    except PdserveError as exc:
        out.e2el = time.perf_counter() - start
        out.error = f"{exc.code.name}: {exc.details}"
    return out


async def send_all(send, requests: list[BenchRequest], arrivals: list[float], run_id: str,
                   max_concurrency: int | None, timeout: float,
                   progress=None) -> tuple[list[RequestOutcome], float]:
    """Send each request at its arrival time with ``send(request, request_id, t0, timeout)``;
    returns (outcomes in trace order, duration)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(request: BenchRequest, at: float) -> RequestOutcome:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        rid = f"{run_id}-{request.index}"
        if gate is None:
            out = await send(request, rid, t0, timeout)
        else:
            async with gate:
                out = await send(request, rid, t0, timeout)
        if progress is not None:
            progress.update(1)
        return out

    outcomes = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals,
                                                                 strict=True)))
    return list(outcomes), time.perf_counter() - t0


def _ms_stats(values: list[float], name: str, percentiles) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    mean = sum(ms) / len(ms) if ms else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if ms else 0.0
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": percentile(ms, 50) if ms else 0.0,
           f"std_{name}_ms": std}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = percentile(ms, p) if ms else 0.0
    return out


def is_good(out: RequestOutcome, goodput: dict[str, float]) -> bool:
    """Meets every SLO (ms) of ``goodput``; a one-token request's TPOT counts as 0."""
    if not out.success:
        return False
    values = {"ttft": out.ttft, "tpot": out.tpot or 0.0, "e2el": out.e2el}
    return all(values[m] * 1e3 <= slo for m, slo in goodput.items())


def compute_metrics(outcomes: list[RequestOutcome], duration: float,
                    goodput: dict[str, float] | None = None,
                    percentile_metrics=METRICS, metric_percentiles=(50.0, 90.0, 99.0)) -> dict:
    """vLLM's result keys (see the module docstring) from the client's timings."""
    ok = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    good = sum(is_good(o, goodput) for o in ok) if goodput else None
    result = {
        "duration": duration, "completed": len(ok), "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "slo_attainment": good / len(outcomes) if goodput else None,
    }
    series = {"ttft": [o.ttft for o in ok], "tpot": [o.tpot for o in ok if o.tpot is not None],
              "itl": [gap for o in ok for gap in o.itl], "e2el": [o.e2el for o in ok]}
    for name in percentile_metrics:
        result.update(_ms_stats(series[name], name, metric_percentiles))
    result.update({"input_lens": [o.prompt_len for o in outcomes],
                   "output_lens": [o.output_len for o in outcomes],
                   "ttfts": [o.ttft for o in outcomes], "itls": [o.itl for o in outcomes],
                   "e2els": [o.e2el for o in outcomes], "start_times": [o.start for o in outcomes],
                   "errors": [o.error for o in outcomes]})
    return result


class WorkerSampler:
    """Samples Admin ``ListWorkers`` every ``interval_s`` while traffic runs: per worker, the
    mean compute and bandwidth utilisation and busy fraction over the samples where it ran."""

    def __init__(self, admin, interval_s: float = 1.0) -> None:
        self.admin = admin
        self.interval_s = interval_s
        self.samples: dict[str, list] = {}  # worker_id -> Worker messages
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            try:
                for w in await asyncio.to_thread(self.admin.list_workers):
                    self.samples.setdefault(w.worker_id, []).append(w)
            except Exception as exc:  # noqa: BLE001 - no Admin service: no samples
                logger.info("worker sampling stopped: %s", exc)
                return
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def summary(self) -> dict[str, dict]:
        out = {}
        for worker_id, samples in self.samples.items():
            busy = [w for w in samples if w.busy_fraction > 0] or samples[-1:]
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            compute = mean([w.compute_utilization for w in busy])
            bandwidth = mean([w.bandwidth_utilization for w in busy])
            out[worker_id] = {"role": samples[-1].role, "samples": len(samples),
                              "compute_utilization": compute,
                              "bandwidth_utilization": bandwidth,
                              "busy_fraction": mean([w.busy_fraction for w in samples]),
                              "binding": (("compute" if compute >= bandwidth else "bandwidth")
                                          if compute or bandwidth else "idle")}
        return out


def prefix_counters(admin) -> tuple[int, int] | None:
    """(prompt tokens the prefix caches served, prompt tokens looked up) summed over the
    workers that prefill (None: the server does not report them)."""
    try:
        workers = [w for w in admin.list_workers() if w.role in ("prefill", "colocated")]
    except Exception as exc:  # noqa: BLE001 - an older or foreign server
        logger.info("no prefix counters: %s", exc)
        return None
    return (sum(w.prefix_hit_tokens for w in workers),
            sum(w.prefix_query_tokens for w in workers))


def settled_prefix_counters(admin, before: tuple[int, int] | None, looked_up: int,
                            wait_s: float = 10.0) -> tuple[int, int] | None:
    """The counters once the workers report at least ``looked_up`` more looked-up prompt
    tokens than ``before`` (the run's prompts: each prefill looks its prompt up once; the
    figures reach Admin with the workers' heartbeats), or as they stand after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        after = prefix_counters(admin)
        if before is None or after is None or after[1] - before[1] >= looked_up \
                or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def hit_rate(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The cluster's prefix-cache hit rate over the run: served / looked-up prompt tokens
    between the two readings (None: not reported, or nothing looked up; a worker replaced
    meanwhile restarts its counters and makes the figure too low)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0, after[0] - before[0]) / (after[1] - before[1])


def traced_hit_rate(traces: list[dict]) -> float | None:
    """The share of the traced requests' prompt tokens that the prefix caches of the workers
    computing them served (a prefill, colocated, or, for a prompt it computed itself, decode
    worker; any tier); None when no trace says where its prompt's tokens were found."""
    sourced = [t for t in traces if t["prefix_source"] is not None]
    looked_up = sum(t["num_prompt_tokens"] for t in sourced)
    if not looked_up:
        return None
    served = sum(t["prefix_source"][k] for t in sourced
                 for k in ("pool_tokens", "host_tokens", "disk_tokens"))
    return served / looked_up


def server_side(admins: list, request_ids: list[str], sampled: dict[str, dict]) -> dict:
    """Traces of ``request_ids`` (each router keeps those it routed; a router without the
    Admin service gives none) -> ``phases``, ``prefill_locations``, ``prefix_hit_rate``
    (:func:`traced_hit_rate`) and ``pool_prompt_tokens`` (the prompt tokens computed on
    prefill or colocated workers, whose prefix caches ``prefix_counters`` reads; a prompt a
    decode worker computed itself is not among them); from the first admin,
    workers' ledgers and sampled utilisation and the server's configuration. Each part is
    None when the server does not offer it."""
    out: dict = {"phases": None, "num_traces": 0, "prefill_locations": None,
                 "prefix_hit_rate": None, "pool_prompt_tokens": None, "workers": None,
                 "server_config": None}
    traces = []
    for admin in admins:
        try:
            traces += [trace_dict(t) for t in admin.get_traces(request_ids)]
        except Exception as exc:  # noqa: BLE001 - an older or foreign server
            logger.info("no traces: %s", exc)
    out["num_traces"] = len(traces)
    out["phases"] = phase_split(traces) if traces else None
    out["prefill_locations"] = prefill_locations(traces)
    if traces:
        out["prefix_hit_rate"] = traced_hit_rate(traces)
        out["pool_prompt_tokens"] = sum(t["num_prompt_tokens"] for t in traces
                                        if t["prefill_location"] != "local")
    admin = admins[0]
    try:
        out["workers"] = {w.worker_id: {"role": w.role, "ledger": json.loads(w.ledger_json or
                                                                            "{}"),
                                        **sampled.get(w.worker_id, {})}
                          for w in admin.list_workers()}
    except Exception as exc:  # noqa: BLE001
        logger.info("no workers: %s", exc)
    try:
        out["server_config"] = admin.get_config()
    except Exception as exc:  # noqa: BLE001
        logger.info("no config: %s", exc)
    return out


async def _benchmark(opts: ServeOptions) -> dict:
    security = {"api_key": opts.api_key, "tls": opts.tls}
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(AsyncPdserveClient(t, **security))
                   for t in opts.targets]
        for client in clients:
            await client.wait_ready(max(opts.wait_ready_s, 1.0))
        info = await clients[0].model_info(timeout=30)
        requests = build_requests(opts, info.vocab_size, info.max_context_tokens)
        arrivals = arrival_times(len(requests), opts.request_rate, opts.burstiness, opts.seed)
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        admins = [stack.enter_context(contextlib.closing(
            AdminClient(t, timeout=30, api_key=opts.admin_api_key, tls=opts.tls)))
            for t in opts.targets]
        sampler = WorkerSampler(admins[0])
        progress = None
        if not opts.disable_tqdm:
            progress = stack.enter_context(tqdm(total=len(requests), desc=opts.progress_desc,
                                                unit="req"))
        before = await asyncio.to_thread(prefix_counters, admins[0])
        sampler.start()
        async with _transport(opts, clients, info.model_name) as send:
            outcomes, duration = await send_all(send, requests, arrivals, run_id,
                                                opts.max_concurrency, opts.timeout_s, progress)
        await sampler.stop()
        side = await asyncio.to_thread(server_side, admins, [o.request_id for o in outcomes],
                                       sampler.summary())
        if side["prefix_hit_rate"] is None:  # (no traces: the workers' counters)
            looked_up = side["pool_prompt_tokens"]
            if looked_up is None:  # (every prompt, as a colocated server computes them)
                looked_up = sum(o.prompt_len for o in outcomes if o.success)
            side["prefix_hit_rate"] = hit_rate(before, await asyncio.to_thread(
                settled_prefix_counters, admins[0], before, looked_up))
    result = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "pdserve",
              "target": opts.target, "base_url": opts.base_url, "model_id": info.model_name,
              "num_prompts": opts.num_prompts, "request_rate": opts.request_rate,
              "burstiness": opts.burstiness, "max_concurrency": opts.max_concurrency,
              "dataset": opts.dataset, "seed": opts.seed, "goodput": dict(opts.goodput),
              "synthetic_shape": asdict(opts.shape)}
    result.update(compute_metrics(outcomes, duration, opts.goodput, opts.percentile_metrics,
                                  opts.metric_percentiles))
    result.update(side)
    return result


@contextlib.asynccontextmanager
async def _transport(opts: ServeOptions, clients: list, model_name: str):
    """``send(request, request_id, t0, timeout)`` over gRPC (request ``i`` to client
    ``i mod n``), or over HTTP with ``base_url``."""
    if opts.base_url is None:
        def send(request: BenchRequest, *args):
            return send_one(clients[request.index % len(clients)], request, *args)
        yield send
        return

    async with HttpCompletions(opts.base_url, model_name, opts.api_key) as http:
        yield http.send


def run_serve(opts: ServeOptions) -> dict:
    """Steps 1-5 of the module docstring; returns the result document."""
    return asyncio.run(_benchmark(opts))
