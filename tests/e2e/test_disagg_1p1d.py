"""One prefill + one decode worker actor, the router actor, Redis, gRPC over loopback.

The tests share one cluster and run in file order; the last two are destructive (a killed
decode worker, which the pool manager replaces, then the shutdown's process check). The
checkpoint's context (2048) and the pools (512 blocks of 4 tokens) are large enough that a long
request outlives a short deadline or a kill by seconds on any machine.
"""

from __future__ import annotations

import asyncio
import math
import time
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve import SamplingParams
from pdserve.api import generation_pb2, generation_pb2_grpc
from pdserve.api.client import AsyncPdserveClient, PdserveClient, PdserveError
from pdserve.bench.otel import OtlpReceiver
from pdserve.cluster.processes import is_running
from pdserve.router.config import RouterConfig
from pdserve.router.grpc_server import SERVICE_NAME
from pdserve.testing.draw_check import draw_problems
from pdserve.testing.waits import wait_for
from pdserve.worker_api.sampling_params import child_seed

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def receiver():
    """An OTLP/gRPC collector the router actor sends its traces to."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir, receiver):
    seen = {}

    def before_workers(c):
        with PdserveClient(c.target) as client:
            seen["health"] = client.health(timeout=10)

    c = start_cluster(model_dir, own_redis=True, stage=before_workers, num_prefill=1,
                      num_decode=1, engine=dict(num_kv_blocks=512),
                      router=RouterConfig(disaggregation="always",  # every KV shipped
                                          otlp_traces_endpoint=receiver.endpoint))
    c.health_before_workers = seen["health"]
    yield c
    c.stop()


def test_health_goes_from_not_serving_to_serving(cluster):
    assert cluster.health_before_workers == "NOT_SERVING"
    with PdserveClient(cluster.target) as client:
        assert client.health(timeout=10) == "SERVING"
        assert client.health(SERVICE_NAME, timeout=10) == "SERVING"


def test_concurrent_greedy_equals_offline(cluster, model_dir, e2e):
    prompts = e2e.prompts(0, 8)
    expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
    results = e2e.generate_all(cluster.target, prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    assert e2e.wait_idle(cluster) == {"prefill-0": 0, "decode-0": 0}
    traces = cluster.traces()
    assert len(traces) >= len(prompts)
    assert all(t.prefill > 0 and t.ttft > 0 for t in traces)


def test_a_request_traced_across_three_processes_continues_the_callers_trace(cluster,
                                                                             receiver):
    """The router actor exports a trace per request to a real OTLP receiver: the caller's
    traceparent is the root's parent, the prefill and decode workers' spans carry their ids."""
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def call():
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[5, 17, 99, 3, 250, 8]),
                sampling=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                       ignore_eos=True))
            return [r async for r in stub.Generate(
                request, metadata=(("traceparent", f"00-{trace_id}-{parent}-01"),))]

    assert asyncio.run(call())[-1].finish_reason == "length"
    names = {"pdserve.v1.Generation/Generate", "prepare", "admission", "placement",
             "decode reservation", "prefill", "prefill queue", "prefill compute",
             "kv transfer", "kv send", "decode"}
    wait_for(lambda: names <= {s.name for s in receiver.trace(bytes.fromhex(trace_id))}, 30,
             "the request's spans at the receiver")
    spans = {s.name: s for s in receiver.trace(bytes.fromhex(trace_id))}
    root = spans["pdserve.v1.Generation/Generate"]
    assert root.parent_span_id == bytes.fromhex(parent)
    assert spans["prefill compute"].parent_span_id == spans["prefill"].span_id
    assert spans["decode"].parent_span_id == root.span_id

    def worker(name: str) -> str:
        return next(kv.value.string_value for kv in spans[name].attributes
                    if kv.key == "pdserve.worker.id")

    assert (worker("prefill"), worker("decode")) == ("prefill-0", "decode-0")


def test_reflection_lists_the_service(cluster):
    async def main():
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            replies = [r async for r in stub.ServerReflectionInfo(iter([request]))]
            return {s.name for s in replies[0].list_services_response.service}

    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= asyncio.run(main())


def test_prometheus_serves_worker_gauges_and_ttft(cluster, e2e):
    with PdserveClient(cluster.target, timeout=60) as client:
        client.generate([5, 6, 7], max_tokens=4, temperature=0.0)

    def scraped():  # worker gauges follow the registry refresh
        text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
        return text if 'pdserve_kv_cache_used_blocks{role="prefill",worker="prefill-0"}' \
            in text else False

    text = e2e.wait_for(scraped, 10, "the worker gauges", 0.2)
    assert 'pdserve_kv_cache_used_blocks{role="decode",worker="decode-0"}' in text
    assert 'pdserve_kv_cache_used_blocks{role="prefill",worker="prefill-0"}' in text
    assert 'pdserve_kv_cache_total_blocks{role="decode",worker="decode-0"} 512.0' in text
    count = [line for line in text.splitlines()
             if line.startswith('pdserve_time_to_first_token_seconds_count{role="router"}')]
    assert count and float(count[0].split()[-1]) >= 1


def test_cancel_mid_stream_and_deadline_free_every_block(cluster, e2e):
    code, got = e2e.cancel_then_deadline(cluster.target)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got, "the deadline should expire mid-stream, after token 0"
    assert e2e.wait_idle(cluster) == {"prefill-0": 0, "decode-0": 0}


def test_n_forks_one_prefill_on_the_decode_worker(cluster, model_dir, e2e):
    """n = 4 across Ray actors: one prefill and one KV shipment, forked on the decode worker;
    greedy choices equal the offline output, seeded ones are each their own seed's draws, a
    cancel frees every sequence."""
    prompt = e2e.prompts(0, 8)[5]
    num_traces = len(cluster.traces())
    with PdserveClient(cluster.target, timeout=60) as client:
        greedy = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                 ignore_eos=True, n=4)
        seeded = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.8, seed=3,
                                 ignore_eos=True, n=3)
        for _chunk in client.generate_stream(prompt, max_tokens=1000, temperature=0.0,
                                             ignore_eos=True, n=4):
            break  # cancel mid-stream
    expected = e2e.reference(model_dir, e2e.prompts(0, 8), MAX_TOKENS)[5]
    assert [c.token_ids for c in greedy.choices] == [expected] * 4
    assert greedy.usage.completion_tokens == 4 * MAX_TOKENS
    alone = [(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8,
                                     seed=child_seed(3, i), ignore_eos=True)) for i in range(3)]
    assert draw_problems(str(model_dir), alone, [c.token_ids for c in seeded.choices]) == []
    assert e2e.wait_idle(cluster) == {"prefill-0": 0, "decode-0": 0}
    traces = cluster.traces()[num_traces:]  # one per request (the cancelled one: none)
    assert [t.num_output_tokens for t in traces] == [4 * MAX_TOKENS, 3 * MAX_TOKENS]
    assert all(t.prefill > 0 and t.num_migrations == 0 for t in traces)


@pytest.mark.parametrize("request_kwargs, field", [
    (dict(prompt=[]), "token_ids"),
    (dict(prompt=""), "text"),
    (dict(prompt=[1, 512]), "token_ids"),
    (dict(prompt=[1, 2], temperature=math.nan), "sampling.temperature"),
    (dict(prompt=[1] * 20, max_tokens=2030), "sampling.max_tokens"),
    (dict(prompt=[1, 2], n=0), "sampling.n"),
    (dict(prompt=[1, 2], n=-1), "sampling.n"),
    (dict(prompt=[1, 2], n=2, best_of=3), "sampling.best_of"),
], ids=["empty-ids", "empty-text", "out-of-vocab", "nan-temperature", "beyond-context",
        "n-zero", "n-negative", "best-of-streamed"])
def test_bad_input_is_invalid_argument_naming_the_field(cluster, request_kwargs, field):
    with PdserveClient(cluster.target, timeout=30) as client:
        with pytest.raises(PdserveError) as err:
            client.generate(**request_kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details


def test_server_stays_healthy_and_correct_after_bad_inputs(cluster, model_dir, e2e):
    prompt = e2e.prompts(0, 8)[3]
    with PdserveClient(cluster.target, timeout=60) as client:
        assert client.health() == "SERVING"
        result = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                 ignore_eos=True)
    assert result.token_ids == e2e.reference(model_dir, e2e.prompts(0, 8), MAX_TOKENS)[3]


def test_ray_handle_translates_worker_errors(cluster, e2e):
    from pdserve.cluster.actors import RayHandle
    from pdserve.worker_api import NeverFits, NoRoomNow, WorkRequest
    from pdserve.worker_api.sampling_params import SamplingParams

    handle = RayHandle(cluster.workers["decode-0"], "decode-0", "decode")
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def request(request_id: str, n: int) -> WorkRequest:
        return WorkRequest(request_id, [7] * n, params, seed=1, arrival_time=time.time())

    async def main():
        with pytest.raises(NeverFits) as too_long:
            await handle.reserve(request("too-long", 4000))
        first = await handle.reserve(request("big-1", 1800))  # 450 of 512 blocks
        try:
            with pytest.raises(NoRoomNow):
                await handle.reserve(request("big-2", 1800))
        finally:
            await handle.abort(first.request_id)
        return str(too_long.value)

    message = asyncio.run(main())
    assert "RayTaskError" not in message and message
    assert e2e.wait_idle(cluster) == {"prefill-0": 0, "decode-0": 0}


def test_a_routers_polls_go_through_the_workers_channel(cluster):
    from pdserve.cluster.actors import RayHandle

    handle = RayHandle(cluster.workers["decode-0"], "decode-0", "decode", router="probe")
    deltas = asyncio.run(handle.poll(0.01))  # nothing of router "probe" to take
    assert list(deltas) == [] and handle.polls is not None and handle.submits is not None


def test_killed_decode_worker_is_replaced_and_serving_resumes(cluster, model_dir, e2e):
    async def one(client, prompt, started):
        try:
            async for chunk in client.generate_stream(prompt, max_tokens=1000, temperature=0.0,
                                                      ignore_eos=True, timeout=120):
                if chunk.token_ids:
                    started.set()
            return "finished"
        except PdserveError as exc:
            return exc.code

    async def main():
        async with AsyncPdserveClient(cluster.target) as client:
            events = [asyncio.Event() for _ in range(2)]
            tasks = [asyncio.create_task(one(client, [3 + i, 4, 5, 6], ev))
                     for i, ev in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), 30)
            await asyncio.to_thread(cluster.kill_worker, "decode-0")
            return await asyncio.gather(*tasks)

    outcomes = asyncio.run(main())
    # each stream either moved to the replacement (migration) or failed UNAVAILABLE
    assert set(outcomes) <= {grpc.StatusCode.UNAVAILABLE, "finished"}

    def replaced():
        cluster.refresh_workers()
        return set(cluster.workers) == {"prefill-0", "decode-1"}

    e2e.wait_for(replaced, 120, "decode-1 to replace the killed decode-0")

    def serving():
        with PdserveClient(cluster.target, timeout=10) as client:
            return client.health() == "SERVING"

    e2e.wait_for(serving, 120, "SERVING again")
    prompt = e2e.prompts(0, 8)[3]
    with PdserveClient(cluster.target, timeout=60) as client:
        result = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                 ignore_eos=True)
    assert result.token_ids == e2e.reference(model_dir, e2e.prompts(0, 8), MAX_TOKENS)[3]


def test_shutdown_leaves_no_processes(cluster):
    pids = cluster.started_pids()
    assert len(pids) == 5  # router, prefill, decode-0 (killed), decode-1, redis-server
    cluster.stop()
    assert [pid for pid in pids if is_running(pid)] == []
    cluster.stop()  # idempotent
