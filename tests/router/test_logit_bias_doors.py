"""``logit_bias`` at the front doors, over real loopback gRPC and HTTP against the FakeBackend:
a good map reaches the router as ``SamplingParams.logit_bias`` (token ids as ints), a bad one
is INVALID_ARGUMENT / a 400 naming ``logit_bias`` (and the key), and a fuzz of maps never
gets anything else. The engine's side: tests/engine/test_logit_bias.py."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.api import generation_pb2 as pb
from pdserve.api import generation_pb2_grpc
from pdserve.api.client import build_generate_request
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.validation import client_request_from_proto
from pdserve.testing.fake_backend import FakeBackend
from pdserve.worker_api.sampling_params import MAX_LOGIT_BIAS

MODEL = "fake-counter"
VOCAB = 64  # FakeBackend's

BAD_MAPS = [  # (logit_bias, what the error says)
    ({"-1": 1}, "token ids"), ({str(VOCAB): 1}, f"outside the vocabulary [0, {VOCAB})"),
    ({str(2**63): 1}, "token ids"), ({"1": 1e30}, "logit_bias of token 1"),
    ({"1": 101}, "logit_bias of token 1"), ({"1": -100.5}, "logit_bias of token 1"),
    ({"x": 1}, "keys must be token ids"), ({"1.5": 1}, "keys must be token ids"),
    ({"1": "a"}, "logit_bias of token 1"), ({"1": None}, "logit_bias of token 1"),
    ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS} entries")]


@pytest.fixture(scope="module")
def http(fake_http):
    """(backend, a client of the HTTP door over a FakeBackend): one client for the module, as
    a client per request costs more than the request (each builds its TLS context)."""
    backend, url = fake_http
    with httpx.Client(base_url=url, timeout=10) as client:
        yield backend, client


def post(client: httpx.Client, path: str, body: dict | str) -> httpx.Response:
    if isinstance(body, str):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": [1, 2]}),
                                        ("/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "hi"}]})])
def test_http_logit_bias_reaches_the_router_as_token_ids(http, path, extra):
    backend, client = http
    response = post(client, path, {"model": MODEL, "max_tokens": 2, **extra,
                                   "logit_bias": {"5": 100, "7": -100, "0": 0.5}})
    assert response.status_code == 200, response.text
    assert backend.started[-1].params.logit_bias == {5: 100.0, 7: -100.0, 0: 0.5}
    post(client, path, {"model": MODEL, "max_tokens": 2, **extra, "logit_bias": {}})
    assert backend.started[-1].params.logit_bias is None


@pytest.mark.parametrize("bias,message", BAD_MAPS)
def test_http_bad_maps_are_a_400_naming_logit_bias(http, bias, message):
    response = post(http[1], "/v1/completions",
                    {"model": MODEL, "prompt": [1], "logit_bias": bias})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and message in error["message"], error


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_http_non_finite_bias_is_a_400_naming_logit_bias(http, raw):
    """JSON has no NaN or Infinity, but Python's encoders (and many clients) send them."""
    response = post(http[1], "/v1/completions",
                    f'{{"model": "{MODEL}", "prompt": [1], "logit_bias": {{"3": {raw}}}}}')
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias"


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.one_of(st.integers(-2**70, 2**70).map(str), st.text(max_size=6)),
                       st.one_of(st.floats(allow_nan=True), st.integers(-2**70, 2**70),
                                 st.booleans(), st.none(), st.text(max_size=3)), max_size=8))
def test_http_fuzzed_maps_are_served_or_named(http, bias):
    response = post(http[1], "/v1/completions",
                    json.dumps({"model": MODEL, "prompt": [1], "max_tokens": 1,
                                "logit_bias": bias}))
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert response.json()["error"]["param"] == "logit_bias", response.text


# -- gRPC ------------------------------------------------------------------------------------

async def _grpc(request: pb.GenerateRequest, backend: FakeBackend) -> list:
    server = GenerationServer(backend, health_poll_interval_s=0.02)
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return [r async for r in stub.Generate(request)]
    finally:
        await server.stop(0)


def test_grpc_logit_bias_reaches_the_router_and_bad_maps_are_invalid_argument():
    backend = FakeBackend()
    request = build_generate_request([1, 2], max_tokens=2, logit_bias={5: 100.0, 63: -1})
    asyncio.run(_grpc(request, backend))
    assert backend.started[-1].params.logit_bias == {5: 100.0, 63: -1.0}
    for bias, message in [({-1: 1}, "token ids"), ({VOCAB: 1}, "outside the vocabulary"),
                          ({1: 1e30}, "logit_bias of token 1"),
                          ({1: float("nan")}, "logit_bias of token 1"),
                          ({i: 1 for i in range(MAX_LOGIT_BIAS + 1)}, "at most")]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(_grpc(build_generate_request([1], logit_bias=bias), FakeBackend()))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.logit_bias" in info.value.details() and message in \
            info.value.details(), info.value.details()


def test_the_proto_map_becomes_the_params_map():
    from pdserve.router.backend import ModelSpec

    model = ModelSpec("m", max_context_tokens=32, vocab_size=100, eos_token_ids=(2,))
    request = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logit_bias={3: 2.5}))
    assert client_request_from_proto(request, model).params.logit_bias == {3: 2.5}
    assert client_request_from_proto(pb.GenerateRequest(text="x"), model).params.logit_bias \
        is None
