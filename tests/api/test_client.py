"""PdserveClient and AsyncPdserveClient against a real gRPC server with the FakeBackend."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from pdserve.api.client import (
    AsyncPdserveClient,
    PdserveClient,
    PdserveError,
    Usage,
    build_generate_request,
)
from pdserve.router.errors import QueueFullError


def test_build_request_sets_only_given_fields_and_keeps_zeros():
    request = build_generate_request("hi", temperature=0.0, seed=0, stop="\n")
    assert request.WhichOneof("input") == "text"
    sampling = request.sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0.0
    assert sampling.HasField("seed") and sampling.seed == 0
    assert not sampling.HasField("max_tokens") and not sampling.HasField("top_p")
    assert list(sampling.stop) == ["\n"]
    ids = build_generate_request([], request_id="r", stop_token_ids=[1, 2], ignore_eos=False)
    assert ids.WhichOneof("input") == "token_ids" and list(ids.token_ids.ids) == []
    assert ids.request_id == "r" and list(ids.sampling.stop_token_ids) == [1, 2]
    assert ids.sampling.HasField("ignore_eos")
    with pytest.raises(TypeError):
        build_generate_request("hi", temprature=0.5)


def test_build_request_carries_structured_outputs_as_the_server_reads_them():
    from pdserve.router.backend import ModelSpec
    from pdserve.router.validation import client_request_from_proto

    model = ModelSpec("m", max_context_tokens=32, vocab_size=100, eos_token_ids=(2,))
    for given, field, expected in [
            ({"json": {"type": "object"}}, "json", '{"type": "object"}'),
            ({"json": '{"type": "string"}'}, "json", '{"type": "string"}'),
            ({"choice": ["a", "b"]}, "choice", ("a", "b")),
            ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
            ({"json_object": True}, "json_object", True),
            ({"structural_tag": {"triggers": ["<w>"], "structures": []}}, "structural_tag",
             '{"structures": [], "triggers": ["<w>"]}')]:
        request = build_generate_request("hi", structured_outputs=given)
        params = client_request_from_proto(request, model).params
        assert getattr(params.structured_outputs, field) == expected
    assert not build_generate_request("hi").sampling.HasField("structured_outputs")


def test_package_reexports_the_clients():
    import pdserve.api

    assert pdserve.api.PdserveClient is PdserveClient
    assert pdserve.api.AsyncPdserveClient is AsyncPdserveClient
    with pytest.raises(AttributeError):
        pdserve.api.NoSuchClient  # noqa: B018


def test_sync_generate_and_stream(start_server):
    background = start_server(tokens_per_delta=3)
    with PdserveClient(background.target, timeout=10) as client:
        result = client.generate([7], max_tokens=8, request_id="abc", temperature=0.0)
        assert result.token_ids == list(range(8, 16))
        assert result.text == background.backend.decode(result.token_ids)
        assert (result.request_id, result.finish_reason) == ("abc", "length")
        assert result.usage == Usage(prompt_tokens=1, completion_tokens=8)
        assert result.logprobs is None
        chunks = list(client.generate_stream("AB", max_tokens=8, stop_token_ids=[5]))
        assert [c.token_ids for c in chunks] == [[2, 3, 4], [5]]
        assert [c.finish_reason for c in chunks] == [None, "stop"]
        assert chunks[0].usage is None and chunks[-1].usage == Usage(2, 4)
        with_logprobs = client.generate([0], max_tokens=2, logprobs=1)
        assert [sorted(d) for d in with_logprobs.logprobs] == [[1], [2]]
    assert background.backend.aborted_ids == []


def test_sync_errors_carry_the_grpc_code(start_server):
    background = start_server()
    with PdserveClient(background.target, timeout=10) as client:
        with pytest.raises(PdserveError) as info:
            client.generate("hello", top_p=1.5)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.top_p" in info.value.details
        with pytest.raises(PdserveError) as info:
            client.generate([10_000])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "token_ids" in info.value.details
        background.backend.fail_with = QueueFullError("queue full")
        with pytest.raises(PdserveError) as info:
            client.generate("hello")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        background.backend.fail_with = None
        assert client.generate("A", max_tokens=2).token_ids == [1, 2]  # still correct


def test_sync_stream_left_early_cancels_and_aborts_once(start_server):
    background = start_server(token_delay_s=0.01)
    with PdserveClient(background.target, timeout=10) as client:
        stream = client.generate_stream([1], request_id="leave", max_tokens=200, ignore_eos=True)
        for index, _ in enumerate(stream):
            if index == 2:
                break
        stream.close()
        background.wait_until(lambda: background.server.num_active_requests == 0, "cleanup")
        assert background.backend.aborted_ids == ["leave"]


def test_sync_timeout_is_deadline_exceeded(start_server):
    background = start_server(token_delay_s=0.01)
    with PdserveClient(background.target) as client:
        with pytest.raises(PdserveError) as info:
            client.generate([1], request_id="late", max_tokens=200, ignore_eos=True,
                            timeout=0.2)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        background.wait_until(lambda: background.server.num_active_requests == 0, "cleanup")
        assert background.backend.aborted_ids == ["late"]


def test_sync_tokenize_model_info_health_and_wait_ready(start_server):
    background = start_server(ready=False)
    with PdserveClient(background.target, timeout=10) as client:
        assert client.health() == "NOT_SERVING"
        with pytest.raises(PdserveError) as info:
            client.wait_ready(timeout=0.2)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        background.backend.ready = True
        client.wait_ready(timeout=5)
        assert client.health() == "SERVING"
        assert client.health("pdserve.v1.Generation") == "SERVING"
        assert client.tokenize("ABC") == [0, 1, 2]
        info = client.model_info()
        assert (info.model_name, info.vocab_size, info.eos_token_ids) == ("fake-counter", 64, [63])


def test_sync_client_to_a_closed_port_is_unavailable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with PdserveClient(f"127.0.0.1:{port}", timeout=2) as client:
        with pytest.raises(PdserveError) as info:
            client.generate("A")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_async_client(start_server):
    background = start_server(tokens_per_delta=2, token_delay_s=0.002)

    async def body():
        async with AsyncPdserveClient(background.target, timeout=10) as client:
            await client.wait_ready(timeout=5)
            assert await client.health() == "SERVING"
            result = await client.generate("A", max_tokens=5, seed=1)
            assert result.token_ids == [1, 2, 3, 4, 5] and result.finish_reason == "length"
            assert result.usage == Usage(1, 5)
            chunks = [c async for c in client.generate_stream([3], max_tokens=3)]
            assert [c.token_ids for c in chunks] == [[4, 5], [6]]
            with pytest.raises(PdserveError) as info:
                await client.generate("A", frequency_penalty=float("-inf"))
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.frequency_penalty" in info.value.details
            stream = client.generate_stream([1], request_id="async-leave", max_tokens=200,
                                            ignore_eos=True)
            async for _ in stream:
                break
            await stream.aclose()
            assert await client.tokenize("B") == [1]
            assert (await client.model_info()).max_context_tokens == 256
            results = await asyncio.gather(*(client.generate([i], max_tokens=3)
                                             for i in range(8)))
            assert [r.token_ids[0] for r in results] == list(range(1, 9))

    asyncio.run(asyncio.wait_for(body(), 30))
    background.wait_until(lambda: background.server.num_active_requests == 0, "cleanup")
    assert background.backend.aborted_ids == ["async-leave"]
