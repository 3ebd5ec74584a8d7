"""Serving overhead: ``python -m pdserve.bench.overhead [--model DIR] [--concurrency 1 8]
[--dtype bfloat16] [--worker-cpus 2]``.

The same requests (random token ids, ``--input-len`` prompt tokens, ``--output-len`` output
tokens each, greedy with ignore_eos) at the same concurrency (closed loop: a request is sent as
soon as one ends) through three paths, one at a time:

* ``offline``: the engine in this process on ``--worker-cpus`` torch threads (default one),
  stepped by a loop that adds a request as soon as a slot frees; its times come from the
  tokens each step returns;
* ``grpc``: one colocated worker with ``--worker-cpus`` CPUs (one: what ``bench.peer`` puts
  against vLLM on one core) behind an embedded cluster's router, driven by ``pdserve bench
  serve``'s client;
* ``http``: the same cluster's OpenAI front door, the same client over ``/v1/completions``.

Prints output tok/s, TTFT P50 and TPOT P50 per path and concurrency, each beside its ratio to
the offline figure: what the router, Ray and the front door cost on top of the engine; and, for
the served paths, TTFT's split (``bench.phases``): the worker's queue and prefill, and the
part no worker timed (placing, RPCs, polling: "router"); and the CPU per output token of the
worker's computing threads and of every other thread on the machine (router, Ray, the
worker's serving threads, Redis, client: ``bench.thread_cpu``). The served paths share this
machine's cores with their client, as ``vllm bench serve`` does.
Never asserts; not part of ``make test``.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from pdserve.bench import thread_cpu
from pdserve.bench.serve import ServeOptions, compute_metrics, run_serve
from pdserve.bench.stats import format_table
from pdserve.bench.workload import BenchRequest, RequestOutcome, SyntheticShape, synthetic_requests
from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster
from pdserve.engine.llm import LLM
from pdserve.models import tiny_model_dir
from pdserve.models.checkpoint import open_checkpoint
from pdserve.worker_api.sampling_params import SamplingParams

FIGURES = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT P50 ms"),
           ("median_tpot_ms", "TPOT P50 ms"))
TRACE_PHASES = ("queue", "prefill", "router")  # the served paths' TTFT split (bench.phases)
CPU_KINDS = ("computing", "other")  # the served paths' CPU per output token (bench.thread_cpu)


def offline(model: str, requests: list[BenchRequest], concurrency: int,
            dtype: str = "float32", threads: int = 1) -> dict:
    """``requests`` through the engine in this process, ``concurrency`` at a time, on
    ``threads`` torch threads (the process's own count is restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _offline(model, requests, concurrency, dtype)
    finally:
        torch.set_num_threads(before)


def _offline(model: str, requests: list[BenchRequest], concurrency: int, dtype: str) -> dict:
    engine = LLM(model, dtype=dtype).engine
    outcomes = {str(i): RequestOutcome(str(i), r.prompt_len) for i, r in enumerate(requests)}
    pending = list(enumerate(requests))
    sent, last = {}, {}
    start = time.perf_counter()

    def send() -> None:
        i, request = pending.pop(0)
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0,
                                ignore_eos=True)
        engine.add_request(str(i), request.prompt, params)
        sent[str(i)] = time.perf_counter()
        outcomes[str(i)].start = sent[str(i)] - start

    while pending and len(sent) < concurrency:
        send()
    while engine.has_unfinished_requests():
        deltas = engine.render(engine.step())
        now = time.perf_counter()
        for delta in deltas:
            out = outcomes[delta.request_id]
            if delta.new_token_ids:
                if out.output_len == 0:
                    out.ttft = now - sent[delta.request_id]
                else:
                    out.itl.append(now - last[delta.request_id])
                out.output_len += len(delta.new_token_ids)
                last[delta.request_id] = now
            if delta.finish_reason is not None:
                out.e2el, out.success = now - sent[delta.request_id], True
                if pending:
                    send()
    return compute_metrics(list(outcomes.values()), time.perf_counter() - start)


def served(cluster, shape: SyntheticShape, num_prompts: int, concurrency: int, seed: int,
           http: bool, computing_threads: int = 1) -> dict:
    """The served run's metrics, with ``cpu_ms_per_token``: the CPU the worker's
    ``computing_threads`` busiest threads and everything else on the machine used, per output
    token (``bench.thread_cpu``)."""
    opts = ServeOptions(target=cluster.target, base_url=cluster.http_url if http
                        else None, wait_ready_s=120, num_prompts=num_prompts,
                        max_concurrency=concurrency, seed=seed, shape=shape, disable_tqdm=True)
    before = thread_cpu.snapshot()
    result = run_serve(opts)
    cpu_s = thread_cpu.split(before, thread_cpu.snapshot(), computing_threads)
    tokens = max(1, result["total_output_tokens"])
    result["cpu_ms_per_token"] = {kind: 1e3 * s / tokens for kind, s in cpu_s.items()}
    return result


def table(results: dict[tuple[str, int], dict]) -> str:
    rows = []
    for (path, concurrency), result in results.items():
        base = results.get(("offline", concurrency))
        row = [path, concurrency]
        for key, _label in FIGURES:
            value = result[key]
            ratio = f" ({value / base[key]:.2f}x)" if base and path != "offline" else ""
            row.append(f"{value:,.1f}{ratio}")
        phases = result.get("phases") or {}
        row += [f"{phases[phase]['p50_ms']:,.1f}" if phase in phases else "-"
                for phase in TRACE_PHASES]
        cpu = result.get("cpu_ms_per_token") or {}
        row += [f"{cpu[kind]:,.2f}" if kind in cpu else "-" for kind in CPU_KINDS]
        rows.append(row)
    return format_table(["path", "concurrency", *(label for _key, label in FIGURES),
                         *(f"{phase} P50 ms" for phase in TRACE_PHASES),
                         *(f"{kind} CPU ms/tok" for kind in CPU_KINDS)], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--paths", default="offline,grpc,http")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--worker-cpus", type=int, default=1,
                        help="the served worker's CPUs (its threads), the offline engine's threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    model = args.model or str(tiny_model_dir())
    shape = SyntheticShape(input_mean=args.input_len, output_mean=args.output_len, sigma=0.0)
    vocab = open_checkpoint(model).model_config.vocab_size
    paths = args.paths.split(",")
    # every run its own prompts (of the same lengths): a run repeating an earlier run's
    # prompts would be served from the prefix cache
    seeds = {(path, c): i for i, (path, c) in enumerate(
        (path, c) for c in args.concurrency for path in ("offline", "grpc", "http"))}
    results: dict[tuple[str, int], dict] = {}
    for c in args.concurrency if "offline" in paths else []:
        requests = synthetic_requests(args.num_prompts, seeds[("offline", c)], vocab, 1 << 30,
                                      shape)
        results[("offline", c)] = offline(model, requests, c, args.dtype, args.worker_cpus)
    if {"grpc", "http"} & set(paths):
        options = ClusterOptions(model=model, colocated=True, num_decode=1, port=0,
                                 http_port=0, metrics_port=None, worker_cpus=args.worker_cpus,
                                 engine=dict(dtype=args.dtype))
        with EmbeddedCluster(options) as cluster:
            for c in args.concurrency:
                for path in ("grpc", "http"):
                    if path in paths:
                        results[(path, c)] = served(cluster, shape, args.num_prompts, c,
                                                    seeds[(path, c)], http=path == "http",
                                                    computing_threads=args.worker_cpus)
    order = {"offline": 0, "grpc": 1, "http": 2}
    print(table(dict(sorted(results.items(), key=lambda kv: (kv[0][1], order[kv[0][0]])))))


if __name__ == "__main__":
    main()
