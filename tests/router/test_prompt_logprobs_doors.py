"""Completions' ``echo`` and prompt logprobs at the front doors, over real loopback HTTP and
gRPC against the FakeBackend (whose prompt logprobs are log(0.5) for each prompt token, the
next ids after it less likely): the prompt's text before the completion, its logprobs object
first (the first token's null), ``max_tokens: 0`` with echo (lm-eval's loglikelihood
request), streamed and not; gRPC's ``prompt_logprobs`` on the first chunk only. The engine's
side: tests/engine/test_prompt_logprobs.py."""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import httpx
import pytest

from pdserve.api import generation_pb2 as pb
from pdserve.api import generation_pb2_grpc
from pdserve.api.client import PromptLogprob, _chunk, build_generate_request
from pdserve.router.grpc_server import GenerationServer
from pdserve.testing.fake_backend import FakeBackend

MODEL = "fake-counter"
HALF = math.log(0.5)


@pytest.fixture(scope="module")
def http(fake_http):
    """(backend, url of completions) of the HTTP door over a FakeBackend."""
    backend, url = fake_http
    return backend, url + "/v1/completions"


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url, json={"model": MODEL, **body}, timeout=10)


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.split("\n\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_echo_puts_the_prompt_text_before_the_completion(http):
    backend, url = http
    out = complete(url, prompt="BCD", max_tokens=2, echo=True).json()["choices"][0]
    assert out["text"] == "BCD" + "EF" and out["logprobs"] is None
    assert backend.started[-1].params.prompt_logprobs is None  # (no logprobs: none computed)
    ids = complete(url, prompt=[3, 4, 5], max_tokens=1, echo=True).json()["choices"][0]
    assert ids["text"] == "DEF" + "G"  # a prompt of ids echoes its tokens' texts


def test_echo_with_logprobs_covers_the_prompt_then_the_output(http):
    backend, url = http
    out = complete(url, prompt="BCD", max_tokens=2, echo=True, logprobs=2).json()
    lp = out["choices"][0]["logprobs"]
    assert backend.started[-1].params.prompt_logprobs == 2
    assert lp["tokens"] == ["B", "C", "D", "E", "F"]
    assert lp["token_logprobs"] == [None] + [HALF] * 4
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {
        "C": HALF, "D": math.log(0.25)}
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_max_tokens_0_with_echo_returns_the_prompt_alone(http):
    """lm-eval's ``local-completions`` loglikelihood request: the prompt's logprobs, no
    output; the engine ran with max_tokens 1 and the door dropped that token."""
    backend, url = http
    body = dict(prompt="BCDE", max_tokens=0, echo=True, logprobs=1, temperature=0)
    out = complete(url, **body).json()
    choice = out["choices"][0]
    assert backend.started[-1].params.max_tokens == 1
    assert choice["text"] == "BCDE" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, HALF, HALF, HALF]
    assert out["usage"]["completion_tokens"] == 0
    streamed = events(complete(url, stream=True, **body))
    assert "".join(e["choices"][0]["text"] for e in streamed) == "BCDE"
    assert streamed[0]["choices"][0]["logprobs"]["tokens"] == ["B", "C", "D", "E"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_echo_sends_the_prompt_as_the_first_chunk(http):
    _, url = http
    chunks = events(complete(url, prompt="BCD", max_tokens=2, echo=True, logprobs=0,
                             stream=True))
    assert [c["choices"][0]["text"] for c in chunks] == ["BCD", "E", "F"]
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [3]


@pytest.mark.parametrize("body,param", [({"max_tokens": 0}, "max_tokens"),
                                         ({"echo": True, "logprobs": 21}, "logprobs"),
                                         ({"suffix": "x"}, "suffix")])
def test_what_stays_refused_is_a_400_naming_it(http, body, param):
    response = complete(http[1], prompt="BC", **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_grpc_prompt_logprobs_come_on_the_first_chunk_only():
    async def run() -> list[pb.GenerateResponse]:
        server = GenerationServer(FakeBackend(tokens_per_delta=1), health_poll_interval_s=0.02)
        port = await server.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                request = build_generate_request([5, 9, 11], max_tokens=3, prompt_logprobs=2)
                return [r async for r in stub.Generate(request)]
        finally:
            await server.stop(0)

    chunks = asyncio.run(run())
    assert len(chunks) == 3 and [len(c.prompt_logprobs) for c in chunks] == [3, 0, 0]
    first = _chunk(chunks[0]).prompt_logprobs
    assert first[0] is None
    assert first[1] == PromptLogprob(HALF, {9: HALF, 10: math.log(0.25)})
    assert first[2] == PromptLogprob(HALF, {11: HALF, 12: math.log(0.25)})


def test_grpc_prompt_logprobs_out_of_range_are_invalid_argument():
    from pdserve.router.backend import ModelSpec
    from pdserve.router.errors import RequestValidationError
    from pdserve.router.validation import client_request_from_proto

    model = ModelSpec("m", max_context_tokens=32, vocab_size=100, eos_token_ids=(2,))
    for bad in (-1, 21):
        with pytest.raises(RequestValidationError) as info:
            client_request_from_proto(build_generate_request("x", prompt_logprobs=bad), model)
        assert info.value.field == "sampling.prompt_logprobs"
