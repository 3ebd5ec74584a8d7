"""OpenTelemetry traces of requests (docs/observability.md): the settings, the spans of a
disaggregated request through the real gRPC and HTTP doors and a real OTLP gRPC receiver in
this process, the caller's traceparent, failed attempts as events, a dead collector, and the
SDK never imported when tracing is off."""

from __future__ import annotations

import asyncio
import http.server
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.api import generation_pb2, generation_pb2_grpc
from pdserve.bench.otel import OtlpReceiver
from pdserve.engine.config import EngineConfig
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.config import RouterConfig
from pdserve.router.core import Router
from pdserve.router.directory import StaticDirectory
from pdserve.router.errors import QueueFullError
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.http_server import HttpServer
from pdserve.router.metrics import RouterMetrics
from pdserve.router.otel import RequestOrigin, RequestTimeline, tracing_settings
from pdserve.router.otel_export import OtlpTracing
from pdserve.router.pairing import PrefillLocation
from pdserve.testing.waits import async_wait_for, wait_for
from pdserve.worker_api import PrefillResult, RequestDelta, Reservation, SamplingParams
from pdserve.workers.build import build_local_workers

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_PARENT = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_PARENT}-01"
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# -- settings -------------------------------------------------------------------------------

def test_settings_come_from_the_flag_then_the_standard_environment():
    assert tracing_settings(None, {}) is None
    flag = tracing_settings("http://c:4317", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://e:1"})
    assert (flag.endpoint, flag.protocol, flag.service_name) == ("http://c:4317", "grpc",
                                                                 "pdserve")
    env = tracing_settings(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://e:4318/",
                                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                                  "OTEL_SERVICE_NAME": "router-a",
                                  "OTEL_BSP_MAX_QUEUE_SIZE": "7"})
    assert (env.endpoint, env.protocol, env.service_name, env.max_queue_size) == (
        "http://e:4318/v1/traces", "http/protobuf", "router-a", 7)
    assert tracing_settings("http://c:4317", {"OTEL_SDK_DISABLED": "true"}) is None


def test_bad_settings_name_what_is_wrong():
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        RouterConfig(otlp_traces_endpoint="localhost:4317")
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        RouterConfig(otlp_traces_endpoint="http://:99")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        tracing_settings("http://c:4317", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"})


def test_off_the_sdk_is_never_imported():
    code = ("import sys; from pdserve.router.core import Router; "
            "from pdserve.router.otel import build_tracing; "
            "from pdserve.router.metrics import RouterMetrics; "
            "assert build_tracing(None, {}, RouterMetrics()) is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- a real OTLP receiver -------------------------------------------------------------------

def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def engine(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=96,
                        max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def traced(hf_checkpoint):
    """1 prefill + 1 decode worker, a router tracing to a real OTLP receiver, its gRPC and
    HTTP doors; yields (receiver, the workers, grpc port, http port, run: runs a coroutine on
    the router's loop). Spans are exported every 0.1 s (OTEL_BSP_SCHEDULE_DELAY)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        yield from _traced(hf_checkpoint)


def _traced(hf_checkpoint):
    receiver = OtlpReceiver()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    handles = build_local_workers(engine(hf_checkpoint("llama")), num_prefill=1, num_decode=1)
    settings = tracing_settings(receiver.endpoint, {})
    metrics = RouterMetrics()
    router = Router(ModelSpec("tiny", 256, 509), StaticDirectory(handles),
                    tokenize=lambda text: [5, 6, 7, 8], metrics=metrics,
                    config=RouterConfig(disaggregation="always"),
                    tracing=OtlpTracing(settings, metrics))

    async def start():
        await router.start()
        grpc_door = GenerationServer(router, health_poll_interval_s=0.05)
        http_door = HttpServer(router)
        return grpc_door, http_door, await grpc_door.start("127.0.0.1", 0), \
            await http_door.start("127.0.0.1", 0)

    grpc_door, http_door, grpc_port, http_port = run(start())
    yield receiver, handles, grpc_port, http_port, run
    run(http_door.stop(1.0))
    run(grpc_door.stop(0))
    run(router.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    for h in handles:
        h.close()
    receiver.stop()


def by_name(spans) -> dict:
    out: dict = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_a_disaggregated_request_through_grpc_continues_the_callers_trace(traced):
    receiver, _, grpc_port, _, run = traced

    async def call():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(
                request_id="client-1", token_ids=generation_pb2.TokenIds(ids=[3, 9, 27, 81, 4]),
                sampling=generation_pb2.SamplingParams(max_tokens=6, temperature=0.0,
                                                       ignore_eos=True))
            return [r async for r in stub.Generate(
                request, metadata=(("traceparent", TRACEPARENT), ("tracestate", "k=v")))]

    responses = run(call())
    assert responses[-1].finish_reason == "length"
    trace_id = bytes.fromhex(CALLER_TRACE)
    wait_for(lambda: len(receiver.trace(trace_id)) >= 11, 30, "the request's spans exported")
    spans = by_name(receiver.trace(trace_id))
    root = spans["pdserve.v1.Generation/Generate"][0]
    assert root.parent_span_id == bytes.fromhex(CALLER_PARENT)  # the caller's span
    assert root.kind == root.SPAN_KIND_SERVER
    assert root.trace_state == "k=v"
    a = attrs(root)
    assert a["rpc.system"] == "grpc" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.output_tokens"] == 6 and a["pdserve.attempts"] == 1
    assert a["pdserve.request.id"] != "client-1"  # the router's id, not the client's label
    for name in ("prepare", "admission", "placement", "decode reservation", "prefill",
                 "decode"):
        assert spans[name][0].parent_span_id == root.span_id, name
    prefill = spans["prefill"][0]
    for name in ("prefill queue", "prefill compute", "kv transfer"):
        assert spans[name][0].parent_span_id == prefill.span_id, name
    assert attrs(prefill)["pdserve.worker.role"] == "prefill"
    assert attrs(spans["decode"][0])["pdserve.worker.role"] == "decode"
    assert attrs(prefill)["pdserve.worker.id"] != attrs(spans["decode"][0])["pdserve.worker.id"]
    assert attrs(spans["placement"][0])["pdserve.prefill.location"] == "remote"
    assert attrs(spans["kv transfer"][0])["pdserve.kv.transfer_bytes"] > 0
    sends = sorted(spans["kv send"], key=lambda s: attrs(s)["pdserve.kv.layers"])
    assert [attrs(s)["pdserve.kv.layers"] for s in sends] == ["0-0", "1-1"]  # (2 layers)
    assert sum(attrs(s)["pdserve.kv.send_bytes"] for s in sends) == attrs(
        spans["kv transfer"][0])["pdserve.kv.transfer_bytes"]
    for send in sends:
        assert send.parent_span_id == prefill.span_id
        assert prefill.start_time_unix_nano <= send.start_time_unix_nano
        assert send.end_time_unix_nano <= prefill.end_time_unix_nano
    decode = spans["decode"][0]
    events = [e.name for e in decode.events]
    assert events[0] == "first_token" and "tokens" in events
    assert sum(attrs(e).get("pdserve.tokens", 0) for e in decode.events) == 5  # after token 0
    for s in receiver.trace(trace_id):  # every span inside the root, none an error
        assert root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano
        assert s.end_time_unix_nano <= root.end_time_unix_nano
        assert s.status.code != s.status.STATUS_CODE_ERROR


def test_a_cancelled_request_ends_its_spans_with_an_error(traced):
    receiver, _, grpc_port, _, run = traced
    trace_id = "c" * 32

    async def call():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[3, 9, 27]),
                sampling=generation_pb2.SamplingParams(max_tokens=200, ignore_eos=True))
            stream = stub.Generate(request, metadata=(("traceparent",
                                                       f"00-{trace_id}-{'d' * 16}-01"),))
            await stream.read()  # the first token streamed: cancel mid-decode
            stream.cancel()

    run(call())

    def root():
        return next((s for s in receiver.trace(bytes.fromhex(trace_id))
                     if s.name == "pdserve.v1.Generation/Generate"), None)

    wait_for(root, 30, "the cancelled request's root span")
    assert root().status.code == root().status.STATUS_CODE_ERROR
    assert attrs(root())["error.type"] == "cancelled"
    decode = next(s for s in receiver.trace(bytes.fromhex(trace_id)) if s.name == "decode")
    assert decode.status.code == decode.status.STATUS_CODE_ERROR


def test_http_headers_carry_the_callers_trace_and_a_bad_one_starts_a_new_trace(traced):
    receiver, _, _, http_port, _ = traced
    body = {"model": "tiny", "prompt": [3, 5, 7], "max_tokens": 4, "temperature": 0.0}
    other_trace = "1" * 32

    def post(traceparent: str) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body,
                          headers={"traceparent": traceparent}, timeout=60)

    assert post(f"00-{other_trace}-{'2' * 16}-01").status_code == 200
    before = len(receiver.spans)
    assert post("00-not-a-trace-01").status_code == 200  # malformed: ignored, never a 4xx
    wait_for(lambda: receiver.trace(bytes.fromhex(other_trace)), 30, "the HTTP request's spans")
    root = by_name(receiver.trace(bytes.fromhex(other_trace)))["POST /v1/completions"][0]
    assert attrs(root)["http.route"] == "/v1/completions"

    def new_root():
        return next((s for s in receiver.spans[before:] if s.name == "POST /v1/completions"
                     and s.trace_id != bytes.fromhex(other_trace)), None)

    wait_for(new_root, 30, "the second request's root")
    assert new_root().parent_span_id == b""


def test_a_refused_request_ends_its_trace_with_an_error(hf_checkpoint):
    memory = InMemorySpanExporter()
    metrics = RouterMetrics()
    router = Router(ModelSpec("tiny", 256, 509), StaticDirectory([]), tokenize=list,
                    config=RouterConfig(max_tokens_in_flight=2), metrics=metrics,
                    tracing=OtlpTracing(tracing_settings("http://127.0.0.1:9", {}), metrics,
                                        memory))

    async def main():
        with pytest.raises(QueueFullError):
            async for _ in router.generate(PreparedRequest("x", [1, 2, 3], PARAMS, None)):
                pass
        await router.stop()

    asyncio.run(main())
    (root,) = [s for s in memory.get_finished_spans() if s.name == "pdserve.generate"]
    assert root.status.status_code.name == "ERROR" and "prompt tokens" in root.status.description
    admission = next(s for s in memory.get_finished_spans() if s.name == "admission")
    assert admission.parent.span_id == root.context.span_id
    assert admission.status.status_code.name == "ERROR"


def test_failed_attempts_are_events_with_their_attempt_numbers():
    """A timeline as the router records it: attempt 1 retried before its first token (the
    prefill failed), attempt 2 migrated after three tokens, attempt 3 bounced, attempt 4
    finished; token batches past MAX_TOKEN_EVENTS are coalesced."""
    memory = InMemorySpanExporter()
    tracing = OtlpTracing(tracing_settings("http://127.0.0.1:9", {}), RouterMetrics(), memory)
    tl = RequestTimeline(RequestOrigin("http", "/v1/completions", time.monotonic(),
                                       "00-garbage"), "tiny")
    tl.admitted_at, tl.uid = time.monotonic(), "u"
    reservation = Reservation("u.1", "d0", "a:1", 1, 1, 2, time.time() + 9)
    result = PrefillResult("u.2", RequestDelta("u.2", [1], ""), 0.001, 0.002, 0.001, 64, 0)
    for number, failure in ((1, "retry"), (2, "migration"), (3, "bounce"), (4, None)):
        tl.attempt(number)
        tl.turn()
        tl.placed("d0", None, PrefillLocation("remote"), reservation)
        tl.prefill_sent("p0", None)
        if number == 1:
            tl.failed("retry", "worker_failed", "prefill on p0 failed")
            continue
        tl.prefilled(result)
        for _ in range(3 if failure else 80):
            tl.delta(RequestDelta(f"u.{number}", [7], ""), None)
        if failure:
            tl.failed(failure, "preempted" if failure == "bounce" else "worker_lost", "gone")
    tracing.finish(tl, None, 89, "length")
    tracing.force_flush()
    spans = by_name(memory.get_finished_spans())
    prefills, decodes = spans["prefill"], spans["decode"]
    assert [dict(s.attributes)["pdserve.attempt"] for s in decodes] == [2, 3, 4]
    assert prefills[0].status.status_code.name == "ERROR"
    assert [e.name for e in prefills[0].events] == ["pdserve.retry"]
    assert [e.name for e in decodes[0].events][-1] == "pdserve.migration"
    assert [e.name for e in decodes[1].events][-1] == "pdserve.bounce"
    assert dict(decodes[1].events[-1].attributes)["pdserve.attempt"] == 3
    assert decodes[2].status.status_code.name == "UNSET"
    assert len(decodes[2].events) <= 1 + 32 and sum(
        dict(e.attributes).get("pdserve.tokens", 0) for e in decodes[2].events) == 79
    root = spans["POST /v1/completions"][0]
    assert dict(root.attributes)["pdserve.retries"] == 1
    assert dict(root.attributes)["pdserve.migrations"] == 1
    assert dict(root.attributes)["pdserve.bounces"] == 1
    assert root.parent is None  # a malformed traceparent: a new trace


def test_a_dead_collector_never_fails_or_holds_requests(hf_checkpoint, monkeypatch):
    """Spans for a closed port, from a router over one colocated worker: every request
    succeeds; spans past the queue are dropped and the failed exports are counted, not waited
    for."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = tracing_settings(f"http://127.0.0.1:{port}",
                                {"OTEL_BSP_MAX_QUEUE_SIZE": "8"})
    metrics = RouterMetrics()
    handles = build_local_workers(engine(hf_checkpoint("llama")), colocated=True,
                                  num_decode=1)
    router = Router(ModelSpec("tiny", 256, 509), StaticDirectory(handles), tokenize=list,
                    metrics=metrics,
                    tracing=OtlpTracing(settings, metrics))

    async def one(i: int) -> list[int]:
        tokens = []
        async for delta in router.generate(PreparedRequest(f"r{i}", [3, i + 4, 5], PARAMS,
                                                           None)):
            tokens += delta.token_ids
        return tokens

    def dropped(reason: str) -> float:
        return metrics.registry.get_sample_value("pdserve_otel_spans_dropped_total",
                                                 {"reason": reason}) or 0

    async def main():
        await router.start()
        try:
            results = await asyncio.gather(*(one(i) for i in range(6)))
            assert [len(r) for r in results] == [6] * 6
            await async_wait_for(lambda: dropped("export_failed") > 0, 60,
                                 "a failed export counted")
            assert dropped("queue_full") > 0  # 6 requests x 6 spans into a queue of 8
        finally:
            await router.stop()

    asyncio.run(main())
    for h in handles:
        h.close()


class _HttpCollector(http.server.BaseHTTPRequestHandler):
    """OTLP over HTTP (``POST /v1/traces``, a protobuf ExportTraceServiceRequest)."""

    received: list = []

    def do_POST(self):  # noqa: N802 - the handler's name
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest.FromString(body)
        type(self).received += [(self.path, s) for rs in request.resource_spans
                                for ss in rs.scope_spans for s in ss.spans]
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_spans_go_over_otlp_http_when_the_protocol_says_so():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HttpCollector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = tracing_settings(None, {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
        tracing = OtlpTracing(settings, RouterMetrics())
        tl = RequestTimeline(None, "tiny")
        tl.admitted_at = time.monotonic()
        tracing.finish(tl, None, 0, None)
        tracing.force_flush()
        assert {(path, s.name) for path, s in _HttpCollector.received} == {
            ("/v1/traces", "pdserve.generate"), ("/v1/traces", "admission")}
        tracing.shutdown()
    finally:
        server.shutdown()
