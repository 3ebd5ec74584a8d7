"""The gRPC front door over real loopback gRPC, against the model-free FakeBackend.

Each test runs one event loop (``asyncio.run``) holding both the server and an aio client
channel; the server binds port 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.api import generation_pb2 as pb
from pdserve.api import generation_pb2_grpc
from pdserve.router.errors import NoWorkersError, QueueFullError, RequestTooLargeError
from pdserve.router.grpc_server import SERVICE_NAME, GenerationServer
from pdserve.router.validation import MAX_PROMPT_CHARS_PER_TOKEN, SamplingParams
from pdserve.testing.fake_backend import FakeBackend
from pdserve.worker_api.sampling_params import MAX_STOP_STRINGS

VOCAB = 64  # FakeBackend's default model
MAX_CONTEXT = 256
WAIT_S = 5.0  # bound on waiting for an asynchronous effect


@dataclass
class Harness:
    server: GenerationServer
    backend: FakeBackend
    stub: generation_pb2_grpc.GenerationStub
    health: health_pb2_grpc.HealthStub
    channel: grpc.aio.Channel


@contextlib.asynccontextmanager
async def serving(backend: FakeBackend | None = None):
    backend = backend or FakeBackend()
    server = GenerationServer(backend, health_poll_interval_s=0.02)
    port = await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Harness(server, backend, generation_pb2_grpc.GenerationStub(channel),
                      health_pb2_grpc.HealthStub(channel), channel)
    finally:
        await channel.close()
        await server.stop(0)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def eventually(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def ids_request(ids, request_id: str = "", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(**sampling))


async def collect(stub, request, **kwargs) -> list[pb.GenerateResponse]:
    return [response async for response in stub.Generate(request, **kwargs)]


async def rpc_error(stub, request, **kwargs) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request, **kwargs)
    return info.value


async def health_status(h: Harness, service: str = "") -> int:
    return (await h.health.Check(health_pb2.HealthCheckRequest(service=service))).status


def test_stream_chunks_concatenate_to_the_expected_output():
    async def body():
        async with serving(FakeBackend(tokens_per_delta=2)) as h:
            chunks = await collect(h.stub, ids_request([5, 9], request_id="req-1", max_tokens=7))
            expected, reason = h.backend.expected_output([5, 9], SamplingParams(max_tokens=7))
            assert len(chunks) == 4
            assert [c.request_id for c in chunks] == ["req-1", "", "", ""]
            assert [t for c in chunks for t in c.token_ids] == expected == list(range(10, 17))
            assert "".join(c.text for c in chunks) == h.backend.decode(expected)
            assert reason == "length"
            assert [c.finish_reason for c in chunks] == ["", "", "", "length"]
            assert not any(c.HasField("usage") for c in chunks[:-1])
            assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 7)
            assert h.backend.aborted_ids == []  # a finished request is not aborted
    run(body())


def test_text_prompt_is_tokenized_and_stop_token_ends_with_stop():
    async def body():
        async with serving() as h:
            request = pb.GenerateRequest(text="ABC", sampling=pb.SamplingParams(
                max_tokens=50, stop_token_ids=[5]))
            chunks = await collect(h.stub, request)
            assert [t for c in chunks for t in c.token_ids] == [3, 4, 5]
            assert chunks[-1].finish_reason == "stop"
            assert chunks[-1].usage.prompt_tokens == 3
            assert len(chunks[0].request_id) > 0  # assigned by the server
    run(body())


def test_unset_max_tokens_shrinks_to_the_room_left_in_the_context():
    async def body():
        async with serving() as h:
            prompt = [1] * (MAX_CONTEXT - 3)
            chunks = await collect(h.stub, ids_request(prompt, ignore_eos=True))
            assert chunks[-1].usage.completion_tokens == 3
            assert chunks[-1].finish_reason == "length"
    run(body())


def test_logprobs_are_returned_per_token_best_first():
    async def body():
        async with serving() as h:
            chunks = await collect(h.stub, ids_request([0], max_tokens=3, logprobs=2))
            entries = [e for c in chunks for e in c.logprobs]
            assert len(entries) == 3
            for token_id, entry in zip([1, 2, 3], entries, strict=True):
                assert entry.logprob == pytest.approx(math.log(0.5))
                assert [t.token_id for t in entry.top] == [token_id, token_id + 1]
            none = await collect(h.stub, ids_request([0], max_tokens=3))
            assert all(len(c.logprobs) == 0 for c in none)
    run(body())


NAN, INF = float("nan"), float("inf")
SAMPLING_BAD_VALUES = [
    ("max_tokens", 0), ("max_tokens", -1),
    ("temperature", -0.1), ("temperature", NAN), ("temperature", INF),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", NAN),
    ("top_k", -1),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", NAN),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", INF),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("presence_penalty", NAN),
    ("frequency_penalty", 2.5), ("frequency_penalty", -INF),
    ("logprobs", -1), ("logprobs", 21),
    ("stop", [""]), ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", ["y" * 1000]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [VOCAB]),
]


@pytest.mark.parametrize(("field", "value"), SAMPLING_BAD_VALUES,
                         ids=[f"{f}={v!r}"[:40] for f, v in SAMPLING_BAD_VALUES])
def test_bad_sampling_value_is_invalid_argument_naming_the_field(field, value):
    async def body():
        async with serving() as h:
            error = await rpc_error(h.stub, ids_request([1, 2], **{field: value}))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"sampling.{field}" in error.details()
            assert h.backend.started_ids == []  # never reached the backend
    run(body())


BAD_REQUESTS = [
    ("no-input", pb.GenerateRequest(), "input"),
    ("empty-text", pb.GenerateRequest(text=""), "text"),  # a oneof member has presence
    ("empty-token-ids", pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids"),
    ("negative-id", ids_request([1, -1]), "token_ids"),
    ("id-at-vocab", ids_request([VOCAB]), "token_ids"),
    ("id-huge", ids_request([2**40]), "token_ids"),
    ("prompt-fills-context", ids_request([1] * MAX_CONTEXT), "token_ids"),
    ("text-beyond-context", pb.GenerateRequest(text="A" * (MAX_CONTEXT + 10)), "text"),
    ("prompt-plus-max-tokens", ids_request([1] * 200, max_tokens=57), "sampling.max_tokens"),
    ("request-id-too-long", ids_request([1], request_id="r" * 129), "request_id"),
    ("request-id-space", ids_request([1], request_id="a b"), "request_id"),
    ("request-id-slash", ids_request([1], request_id="a/b"), "request_id"),
    ("request-id-non-ascii", ids_request([1], request_id="r\u00e9q"), "request_id"),
]


@pytest.mark.parametrize(("request_proto", "field"), [(r, f) for _, r, f in BAD_REQUESTS],
                         ids=[name for name, _, _ in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(request_proto, field):
    async def body():
        async with serving() as h:
            error = await rpc_error(h.stub, request_proto)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith(f"{field}:")
    run(body())


def test_max_tokens_that_just_fits_is_accepted():
    async def body():
        async with serving() as h:
            chunks = await collect(h.stub, ids_request([1] * 200, max_tokens=56,
                                                       ignore_eos=True))
            assert chunks[-1].usage.completion_tokens == 56
    run(body())


@pytest.mark.parametrize(("error", "code"), [
    (QueueFullError("queue full: 64 requests"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestTooLargeError("needs 900 blocks, workers hold 512"),
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkersError("no decode workers"), grpc.StatusCode.UNAVAILABLE),
    (RuntimeError("secret internal detail"), grpc.StatusCode.INTERNAL),
], ids=["queue-full", "too-large", "no-workers", "internal"])
def test_backend_errors_map_to_status_codes(error, code):
    async def body():
        backend = FakeBackend()
        backend.fail_with = error
        async with serving(backend) as h:
            rpc = await rpc_error(h.stub, ids_request([1], request_id="r1"))
            assert rpc.code() == code
            if code == grpc.StatusCode.INTERNAL:
                assert "secret" not in rpc.details()
            else:
                assert str(error) in rpc.details()
            await eventually(lambda: h.server.num_active_requests == 0, "request cleanup")
            assert backend.aborted_ids == ["r1"]  # unfinished, so aborted (idempotent)
    run(body())


def test_client_cancel_mid_stream_aborts_exactly_once():
    async def body():
        async with serving(FakeBackend(token_delay_s=0.01)) as h:
            call = h.stub.Generate(ids_request([1], request_id="cancel-me", max_tokens=250,
                                               ignore_eos=True))
            received = 0
            async for _ in call:
                received += 1
                if received == 3:
                    call.cancel()
                    break
            await eventually(lambda: h.server.num_active_requests == 0, "handler to finish")
            assert h.backend.aborted_ids == ["cancel-me"]
            assert h.backend.num_running == 0
    run(body())


def test_deadline_returns_deadline_exceeded_and_aborts_exactly_once():
    async def body():
        async with serving(FakeBackend(token_delay_s=0.01)) as h:
            error = await rpc_error(h.stub, ids_request([1], request_id="slow", max_tokens=250,
                                                        ignore_eos=True), timeout=0.3)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: h.server.num_active_requests == 0, "handler to finish")
            assert h.backend.aborted_ids == ["slow"]
            assert h.backend.num_running == 0
    run(body())


def test_a_request_id_in_flight_is_a_label_two_requests_may_share():
    """The client's request_id is echoed, never a key: a second request with the id of one
    in flight runs as a request of its own, and each stream gets the id back."""
    async def body():
        async with serving(FakeBackend(token_delay_s=0.005)) as h:
            first = h.stub.Generate(ids_request([1], request_id="dup", max_tokens=40,
                                                ignore_eos=True))
            head = await first.read()  # the first request is streaming now
            second = [r async for r in h.stub.Generate(ids_request([5], request_id="dup",
                                                                    max_tokens=3))]
            assert second[0].request_id == head.request_id == "dup"
            assert [t for r in second for t in r.token_ids] == [6, 7, 8]
            rest = []
            while (response := await first.read()) is not grpc.aio.EOF:
                rest.append(response)
            assert rest[-1].usage.completion_tokens == 40
            assert h.backend.started_ids == ["dup", "dup"]
            assert h.backend.aborted_ids == []
    run(body())


def test_server_stop_aborts_requests_in_flight():
    async def body():
        backend = FakeBackend(token_delay_s=0.01)
        async with serving(backend) as h:
            call = h.stub.Generate(ids_request([1], request_id="inflight", max_tokens=250,
                                               ignore_eos=True))
            await call.read()
            await h.server.stop(0)
            with pytest.raises(grpc.aio.AioRpcError):
                while await call.read() is not grpc.aio.EOF:
                    pass
            await eventually(lambda: backend.aborted_ids == ["inflight"], "abort on stop")
    run(body())


class _EndedCall:
    """A servicer context whose call has ended under a write: gRPC fails the write (as its
    ``execute_batch`` does when a stopping server cuts the call)."""

    def __init__(self, cancelled: bool = False):
        self._cancelled = cancelled

    async def write(self, response) -> None:
        raise RuntimeError('Failed "execute_batch"')

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._cancelled


def test_a_write_into_an_ended_call_ends_the_stream_without_an_error(caplog):
    """The client gone, or the server stopping: the stream ends (False) and is logged as
    such; a write that fails on a live call of a running server is still an error."""
    async def body():
        server = GenerationServer(FakeBackend())
        servicer = server._servicer
        response = pb.GenerateResponse()
        assert not await servicer._write(_EndedCall(cancelled=True), response, "gone")
        with pytest.raises(RuntimeError):
            await servicer._write(_EndedCall(), response, "live")
        await server.start("127.0.0.1", 0)
        await server.stop(0)
        assert server.stopping
        assert not await servicer._write(_EndedCall(), response, "cut")
    with caplog.at_level("INFO", logger="pdserve.router.grpc_server"):
        run(body())
    ended = [r.getMessage() for r in caplog.records if "call ended" in r.getMessage()]
    assert len(ended) == 2 and all(r.levelname != "ERROR" for r in caplog.records)


def test_health_not_serving_until_ready_then_serving_and_draining():
    async def body():
        backend = FakeBackend(ready=False)
        async with serving(backend) as h:
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            serving_ = health_pb2.HealthCheckResponse.SERVING
            assert await health_status(h) == not_serving
            assert await health_status(h, SERVICE_NAME) == not_serving
            error = await rpc_error(h.stub, ids_request([1]))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await h.stub.Tokenize(pb.TokenizeRequest(text="A"))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            backend.ready = True
            await eventually(lambda: h.server.is_serving, "SERVING")
            assert await health_status(h) == serving_
            assert await health_status(h, SERVICE_NAME) == serving_
            h.server.set_serving(False)  # drain
            await eventually(lambda: not h.server.is_serving, "NOT_SERVING while draining")
            assert await health_status(h) == not_serving
            error = await rpc_error(h.stub, ids_request([1]))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in error.details()
            h.server.set_serving(True)
            await eventually(lambda: h.server.is_serving, "SERVING after draining")
            assert len(await collect(h.stub, ids_request([1], max_tokens=2))) == 2
    run(body())


def test_generate_reaches_a_backend_that_is_not_ready_yet():
    async def body():
        backend = FakeBackend()
        backend.is_ready = lambda: False  # no worker ready: the backend waits for one
        async with serving(backend) as h:
            assert await health_status(h) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert len(await collect(h.stub, ids_request([1], max_tokens=3))) == 3
            with pytest.raises(grpc.aio.AioRpcError) as info:  # says what health says
                await h.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "not ready" in info.value.details()
    run(body())


def test_reflection_lists_the_service_and_serves_its_descriptor():
    async def body():
        async with serving() as h:
            stub = reflection_pb2_grpc.ServerReflectionStub(h.channel)
            requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(
                            file_containing_symbol=SERVICE_NAME)]
            replies = [r async for r in stub.ServerReflectionInfo(iter(requests))]
            names = {s.name for s in replies[0].list_services_response.service}
            assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
            files = replies[1].file_descriptor_response.file_descriptor_proto
            assert files and b"GenerateRequest" in files[0]
    run(body())


def test_server_stays_healthy_and_correct_after_bad_inputs():
    async def body():
        async with serving() as h:
            for request in [pb.GenerateRequest(), ids_request([VOCAB]),
                            ids_request([1], temperature=NAN), ids_request([1] * 999)]:
                assert (await rpc_error(h.stub, request)).code() == \
                    grpc.StatusCode.INVALID_ARGUMENT
            assert await health_status(h) == health_pb2.HealthCheckResponse.SERVING
            chunks = await collect(h.stub, ids_request([10], max_tokens=5))
            assert [t for c in chunks for t in c.token_ids] == [11, 12, 13, 14, 15]
            assert h.server.num_active_requests == 0
    run(body())


def test_tokenize_and_model_info():
    async def body():
        async with serving() as h:
            reply = await h.stub.Tokenize(pb.TokenizeRequest(text="ABZ"))
            assert list(reply.token_ids) == [0, 1, 25]
            info = await h.stub.GetModelInfo(pb.GetModelInfoRequest())
            assert (info.model_name, info.max_context_tokens, info.vocab_size) == \
                ("fake-counter", MAX_CONTEXT, VOCAB)
            assert list(info.eos_token_ids) == [63]
    run(body())


def test_tokenize_checks_the_text_size_before_tokenizing():
    """A text that could never fit the context is refused unread (as Generate's is)."""
    async def body():
        async with serving() as h:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.Tokenize(pb.TokenizeRequest(
                    text="A" * (MAX_PROMPT_CHARS_PER_TOKEN * MAX_CONTEXT + 1)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("text:")
    run(body())


def test_second_server_on_a_bound_port_fails():
    async def body():
        async with serving() as h:
            other = GenerationServer(FakeBackend())
            with pytest.raises(RuntimeError):
                await other.start("127.0.0.1", h.server.port)
    run(body())
