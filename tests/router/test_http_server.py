"""The OpenAI HTTP front door over real loopback HTTP (uvicorn) against the FakeBackend, with
the official ``openai`` package and raw httpx: completions and chat, stream and not, the usage
chunk rules, every error status in the OpenAI envelope, a mid-stream failure, a disconnect
that aborts, the API key, and a fuzz of request bodies (never a 5xx, never a hang, nothing
left running)."""

from __future__ import annotations

import asyncio
import gc
import json
import select
import socket
import threading

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router import openai_protocol as oa
from pdserve.router.errors import QueueFullError
from pdserve.router.http_server import HttpServer
from pdserve.testing.fake_backend import FakeBackend, FakePromptTools
from pdserve.testing.loop_thread import LoopThread
from pdserve.testing.waits import wait_for
from pdserve.worker_api.sampling_params import SamplingParams

KEY = "http-test-key"
MODEL = "fake-counter"


class MidStreamFailure(FakeBackend):
    """Fails after its first delta."""

    async def generate(self, request):
        inner = super().generate(request)
        try:
            yield await inner.__anext__()
            raise RuntimeError("worker exploded")
        finally:
            await inner.aclose()


@pytest.fixture(scope="module")
def loop():
    loop = LoopThread()
    yield loop
    loop.close()


def _start(loop: LoopThread, backend, **kwargs) -> tuple[HttpServer, str]:
    server = loop.run(_make(backend, kwargs))
    return server, f"http://127.0.0.1:{server.port}"


async def _make(backend, kwargs) -> HttpServer:
    server = HttpServer(backend, model_root="/models/fake", **kwargs)
    await server.start("127.0.0.1", 0)
    return server


@pytest.fixture(scope="module")
def served(loop):
    backend = FakeBackend()
    server, url = _start(loop, backend, tools=FakePromptTools(backend), api_key=KEY,
                         max_body_bytes=64 * 1024)
    yield backend, url
    loop.run(server.stop(1.0))


@pytest.fixture
def fake(served):
    backend, url = served
    backend.ready, backend.fail_with, backend.token_delay_s = True, None, 0.0
    yield backend, url
    wait_for(lambda: backend.num_running == 0, 5, "no request left running")


@pytest.fixture
def client(fake):
    return openai.OpenAI(base_url=fake[1] + "/v1", api_key=KEY, max_retries=0, timeout=10)


def _post(url: str, path: str, body: dict, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=10, **kwargs)


def _events(response: httpx.Response) -> list:
    out = []
    for line in response.text.split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completions_with_the_openai_client(fake, client):
    backend, _ = fake
    ids, reason = backend.expected_output([1, 2, 3], SamplingParams(max_tokens=5))
    out = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5)
    assert out.choices[0].text == backend.decode(ids) and out.choices[0].finish_reason == reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)
    assert out.id.startswith("cmpl-") and out.model == MODEL
    text = client.completions.create(model=MODEL, prompt="BCD", max_tokens=3).choices[0].text
    assert text == "EFG"  # the fake tokenizer: one id per character
    chunks = list(client.completions.create(model=MODEL, prompt=[60], max_tokens=8,
                                            stream=True, temperature=0))
    assert "".join(c.choices[0].text for c in chunks) == backend.decode([61, 62, 63])
    assert chunks[-1].choices[0].finish_reason == "stop"  # 63 is the fake eos


def _server_side_nodelay(port: int) -> list[int]:
    """TCP_NODELAY of every open server-side connection of the front door on ``port`` (its
    asyncio transports, found in this process)."""
    values = []
    for obj in gc.get_objects():
        if issubclass(type(obj), asyncio.Transport) and not obj.is_closing():
            sock = obj.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) \
                    and sock.getsockname()[1] == port and sock.getpeername()[1] != port:
                values.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    return values


def test_streamed_answers_leave_without_waiting_for_acks(fake):
    """Each SSE event goes out as its own small write; Nagle's algorithm would hold every
    one until the client's (delayed) ACK of the one before."""
    _, url = fake
    port = int(url.rsplit(":", 1)[1])
    with httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=10) as http:
        response = http.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": [60], "max_tokens": 3, "stream": True})
        assert response.status_code == 200 and _events(response)[-1] == "[DONE]"
        values = _server_side_nodelay(port)  # the kept-alive connection is still open
    assert values and all(values), values


def test_chat_with_the_openai_client(fake, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
    assert len(out.choices[0].message.content) == 4 and out.usage.completion_tokens == 4
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                            stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].usage
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    logprobs = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                              logprobs=True, top_logprobs=2)
    content = logprobs.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 2


def test_usage_chunk_rules_on_the_wire(fake):
    _, url = fake
    body = {"model": MODEL, "prompt": [5], "max_tokens": 3, "stream": True}
    plain = _events(_post(url, "/v1/completions", body))
    assert plain[-1] == "[DONE]" and all("usage" not in e for e in plain[:-1])
    with_usage = _events(_post(url, "/v1/completions",
                               {**body, "stream_options": {"include_usage": True}}))
    assert with_usage[-1] == "[DONE]"
    chunks = with_usage[:-1]
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "GHI"
    lp = _post(url, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2,
                                        "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["G", "H"] and lp["text_offset"] == [0, 1]
    assert len(lp["top_logprobs"][0]) == 2


def test_n_choices_whole_and_streamed(fake, client):
    """n > 1: choices 0..n-1, each with its own finish_reason; a stream's chunks carry their
    index; usage counts every choice's tokens (the FakeBackend gives each the same count)."""
    _, url = fake
    body = {"model": MODEL, "prompt": [5], "max_tokens": 3, "n": 3}
    whole = _post(url, "/v1/completions", body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert {c["text"] for c in whole["choices"]} == {"GHI"}
    assert all(c["finish_reason"] == "length" for c in whole["choices"])
    assert whole["usage"] == {"prompt_tokens": 1, "completion_tokens": 9, "total_tokens": 10}
    chat = _post(url, "/v1/chat/completions", {"model": MODEL, "n": 2, "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "A"}]})
    contents = [c["message"]["content"] for c in chat.json()["choices"]]
    assert len(contents) == 2 and contents[0] == contents[1] and len(contents[0]) == 2
    stream = _events(_post(url, "/v1/completions", {**body, "stream": True,
                                                    "stream_options": {"include_usage": True}}))
    assert stream[-1] == "[DONE]" and stream[-2]["usage"]["completion_tokens"] == 9
    for index in range(3):
        mine = [c["choices"][0] for c in stream[:-2] if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == "GHI"
        assert [c["finish_reason"] for c in mine] == [None, None, "length"]
    chat_stream = _events(_post(url, "/v1/chat/completions", {
        "model": MODEL, "n": 2, "max_tokens": 2, "stream": True,
        "messages": [{"role": "user", "content": "A"}]}))
    roles = [c["choices"][0]["index"] for c in chat_stream[:-1]
             if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    sdk = client.completions.create(model=MODEL, prompt=[5], max_tokens=2, n=2, best_of=4)
    assert [c.index for c in sdk.choices] == [0, 1] and sdk.usage.completion_tokens == 8


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "prompt": [1], "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": [1], "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": [1], "n": -1}, 400, "n"),
    ({"model": MODEL, "prompt": [1], "n": 2**63}, 400, "n"),
    ({"model": MODEL, "prompt": [1], "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": [1], "n": 3, "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": [1], "best_of": 0}, 400, "best_of"),
    ({"model": MODEL, "prompt": [1], "n": 2, "best_of": 3, "stream": True}, 400, "best_of"),
    ({"model": MODEL, "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [1], "max_tokens": 10_000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "A" * 20_000}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1], "suffix": "x"}, 400, "suffix"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1], "stop": ["x"] * 40}, 400, "stop"),
    ({"model": "other", "prompt": [1]}, 404, "model"),
    # past every array a step packs into: refused where they enter, never inside a step
    ({"model": MODEL, "prompt": [1], "top_k": 10**30}, 400, "top_k"),
    ({"model": MODEL, "prompt": [1], "top_k": 2**63}, 400, "top_k"),
    ({"model": MODEL, "prompt": [1], "max_tokens": 2**63}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": [1], "seed": 2**64}, 400, "seed"),
    ({"model": MODEL, "prompt": [1], "priority": 2**40}, 400, "priority"),
    ({"model": MODEL, "prompt": [1], "repetition_penalty": 1e30}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": [1], "stop_token_ids": [1] * 65}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": [1], "stop_token_ids": [10**30]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": [1], "timeout": 1e30}, 400, "timeout"),
    ({"model": MODEL, "prompt": [1], "timeout": 0}, 400, "timeout"),
    ({"model": MODEL, "prompt": [1], "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ({"model": MODEL, "prompt": [1], "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema.schema"),
    ({"model": MODEL, "prompt": [1], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}}}, 400,
     "response_format.json_schema.schema"),
    ({"model": MODEL, "prompt": [1], "structured_outputs": {"regex": "a", "choice": ["a"]}},
     400, "structured_outputs"),
    ({"model": MODEL, "prompt": [1], "structured_outputs": {"json": "{not json"}}, 400,
     "structured_outputs.json"),
    ({"model": MODEL, "prompt": [1], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": list(range(2000))}}}}, 400,
     "response_format.json_schema.schema"),
    ({"model": MODEL, "prompt": [1], "structured_outputs": {"choice": ["a"]},
      "response_format": {"type": "json_object"}}, 400, "structured_outputs"),
])
def test_bad_requests_get_the_error_envelope(fake, body, status, param):
    response = _post(fake[1], "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and set(error) == {
        "message", "type", "param", "code"}


def test_response_formats_and_structured_outputs_reach_the_backend(fake, client):
    """The official client's ``parse`` with a pydantic model, ``json_object`` on completions,
    and vLLM's ``structured_outputs`` extra: each reaches the router as one
    ``StructuredOutputs``; ``text`` constrains nothing."""
    import pydantic

    class Weather(pydantic.BaseModel):
        city: str
        celsius: int

    backend, _ = fake
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(Exception):  # noqa: B017 - the fake's counter text is not a Weather
        client.chat.completions.parse(model=MODEL, messages=messages, max_tokens=2,
                                      response_format=Weather)
    schema = json.loads(backend.started[-1].params.structured_outputs.json)
    assert schema["properties"] == {"city": {"title": "City", "type": "string"},
                                    "celsius": {"title": "Celsius", "type": "integer"}}
    client.completions.create(model=MODEL, prompt=[1], max_tokens=2,
                              extra_body={"response_format": {"type": "json_object"}})
    assert backend.started[-1].params.structured_outputs.json_object is True
    client.completions.create(model=MODEL, prompt=[1], max_tokens=2,
                              extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert backend.started[-1].params.structured_outputs.choice == ("a", "b")
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                   response_format={"type": "text"})
    assert backend.started[-1].params.structured_outputs is None
    tag = {"type": "structural_tag", "structures": [{"begin": "<w>", "schema": {}, "end": "</w>"}],
           "triggers": ["<w>"]}
    client.completions.create(model=MODEL, prompt=[1], max_tokens=2,
                              extra_body={"response_format": tag})
    assert json.loads(backend.started[-1].params.structured_outputs.structural_tag) == tag


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_reach_the_template_and_forced_choices_the_grammar(fake, client):
    """The fake writes counter text, never a call: ``auto`` answers it as content, a named
    function as that function's arguments (the grammar would have made them JSON), and
    ``required``'s array schema and the tools shown to the template reach the backend."""
    backend, url = fake
    ask = [{"role": "user", "content": "weather?"}]
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3,
                                           tools=[WEATHER_TOOL], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None
    no_tools_prompt = backend.started[-1].prompt_token_ids
    auto = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3,
                                          tools=[WEATHER_TOOL])
    assert len(backend.started[-1].prompt_token_ids) > len(no_tools_prompt)  # tools shown
    assert backend.started[-1].params.structured_outputs is None
    assert auto.choices[0].message.content == plain.choices[0].message.content
    assert auto.choices[0].message.tool_calls is None
    client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3,
                                   tools=[WEATHER_TOOL], tool_choice="required",
                                   parallel_tool_calls=False)
    schema = json.loads(backend.started[-1].params.structured_outputs.json)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3,
                                           tools=[WEATHER_TOOL], tool_choice=named)
    assert json.loads(backend.started[-1].params.structured_outputs.json) == \
        WEATHER_TOOL["function"]["parameters"]
    choice = whole.choices[0]
    assert choice.message.content is None and choice.finish_reason == "length"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and call.function.arguments == plain.choices[0] \
        .message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3,
                                                 tools=[WEATHER_TOOL], tool_choice=named,
                                                 stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"
    two = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3, n=2,
                                         tools=[WEATHER_TOOL], tool_choice=named)
    assert [c.message.tool_calls[0].function.name for c in two.choices] == ["get_weather"] * 2
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3, n=2,
                                                 tools=[WEATHER_TOOL], tool_choice=named,
                                                 stream=True))
    for index in (0, 1):  # each choice streams its own call
        mine = [d for c in chunks for d in c.choices[0].delta.tool_calls or []
                if c.choices[0].index == index]
        assert mine[0].function.name == "get_weather"
        assert "".join(d.function.arguments or "" for d in mine) == call.function.arguments
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "3 degrees"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=3,
                                            tools=[WEATHER_TOOL])
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL] * 2}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400s_naming_the_parameter(fake, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **extra}
    response = _post(fake[1], "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_non_finite_numbers_are_refused_naming_the_field(fake):
    """JSON has no NaN or Infinity, but Python's encoders (and many clients) send them."""
    for field in ("temperature", "top_p", "timeout", "presence_penalty"):
        raw = f'{{"model": "{MODEL}", "prompt": [1], "{field}": NaN}}'
        response = httpx.post(fake[1] + "/v1/completions", content=raw, timeout=10,
                              headers={"authorization": f"Bearer {KEY}",
                                       "content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


def test_malformed_and_large_bodies(loop):
    backend = FakeBackend()
    bound = 3 * oa.INLINE_PARSE_BYTES
    server, url = _start(loop, backend, max_body_bytes=bound)
    try:
        broken = httpx.post(url + "/v1/completions", content=b'{"model": ',
                            headers={"content-type": "application/json"})
        assert broken.status_code == 400 and broken.json()["error"]["message"]
        # above the inline bound (parsed in a thread), below the body bound: served
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2,
                "user": "x" * (2 * oa.INLINE_PARSE_BYTES)}
        response = _post(url, "/v1/completions", body, key=None)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
        too_large = _post(url, "/v1/completions", {**body, "user": "x" * bound}, key=None)
        assert too_large.status_code == 413 and too_large.json()["error"]["code"]
    finally:
        loop.run(server.stop(1.0))
        wait_for(lambda: backend.num_running == 0, 5, "no request left running")


def test_too_many_chat_messages_are_refused_before_the_template(fake):
    """Each message takes a token at least: more messages than the context can never fit."""
    backend, url = fake
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 300}
    response = _post(url, "/v1/chat/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_the_default_body_bound_follows_the_context(loop):
    backend = FakeBackend()
    server, _ = _start(loop, backend)
    try:
        assert server.asgi.max_body_bytes == oa.max_body_bytes(
            backend.model_info().max_context_tokens)
    finally:
        loop.run(server.stop(1.0))


def test_statuses_from_the_backend(fake, client):
    backend, url = fake
    body = {"model": MODEL, "prompt": [1], "max_tokens": 2}
    backend.fail_with = QueueFullError("queue full", retry_after_s=2.2)
    full = _post(url, "/v1/completions", body)
    assert full.status_code == 429 and full.headers["retry-after"] == "3"
    backend.fail_with = QueueFullError("queue full")  # no hint: still a Retry-After
    assert _post(url, "/v1/completions", body).headers["retry-after"] == "1"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt=[1], max_tokens=2)
    backend.fail_with = None
    backend.ready = False
    for response in (_post(url, "/v1/completions", body), httpx.get(url + "/health"),
                     httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})):
        assert response.status_code == 503 and response.json()["error"]["message"]
    backend.ready = True
    backend.token_delay_s = 0.2
    slow = _post(url, "/v1/completions", {**body, "max_tokens": 50, "timeout": 0.3})
    assert slow.status_code == 504 and slow.json()["error"]["code"] == "deadline_exceeded"
    too_big = _post(url, "/v1/completions", {**body, "prompt": "x" * 70_000})
    assert too_big.status_code == 413


def test_a_backend_not_ready_yet_gets_requests_while_health_and_models_say_503(fake,
                                                                              monkeypatch):
    backend, url = fake
    monkeypatch.setattr(backend, "is_ready", lambda: False)  # it waits for a worker, then serves
    body = {"model": MODEL, "prompt": [1], "max_tokens": 2}
    assert _post(url, "/v1/completions", body).status_code == 200
    for path in ("/health", "/v1/models"):
        response = httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 503 and "not ready" in response.json()["error"]["message"]


def test_priority_above_the_default_needs_a_priority_key(loop):
    backend = FakeBackend()
    server, url = _start(loop, backend, api_key=KEY, priority_api_keys=("prio-key",))
    try:
        body = {"model": MODEL, "prompt": [1], "max_tokens": 1}
        refused = _post(url, "/v1/completions", {**body, "priority": -1})
        assert refused.status_code == 403
        error = refused.json()["error"]
        assert error["param"] == "priority" and error["type"] == "permission_error"
        assert "priority key" in error["message"]
        for key, priority in ((KEY, 0), (KEY, 7), ("prio-key", -3)):
            response = _post(url, "/v1/completions", {**body, "priority": priority}, key=key)
            assert response.status_code == 200, response.text
        # (each stream is closed once its response has gone)
        wait_for(lambda: backend.num_running == 0, 5, "no request left running")
    finally:
        loop.run(server.stop(1.0))
    server, url = _start(loop, backend)  # no key at all: nothing gated
    try:
        assert _post(url, "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 1,
                                              "priority": -9}, key=None).status_code == 200
    finally:
        loop.run(server.stop(1.0))


def _trickle(port: int, start: bytes, trickle: bytes, out: dict) -> None:
    """A slowloris client: sends ``start``, then ``trickle`` one byte per 0.2 s until the server
    answers or closes; ``out`` gets whether it was cut off before the end and what it read."""
    with socket.create_connection(("127.0.0.1", port), 10) as sock:
        sock.sendall(start)
        cut = False
        for byte in trickle:
            if select.select([sock], [], [], 0.2)[0]:  # an answer, or the close
                cut = True
                break
            try:
                sock.sendall(bytes([byte]))
            except ConnectionError:
                cut = True
                break
        answer = b""
        sock.settimeout(10)
        try:
            while cut and (chunk := sock.recv(4096)):
                answer += chunk
        except ConnectionError:
            pass
        out.update(cut=cut, answer=answer)


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_slowloris_client_is_cut_off_and_does_not_block_others(loop, part):
    """Two clients trickle a request a byte per 0.2 s into a server whose max_concurrency
    leaves no room for a third connection (uvicorn counts the open ones, the asking one
    included): each is answered 408 and closed after read_timeout_s (in the head case before
    its key was ever seen), and a well-behaved request is then served."""
    backend = FakeBackend()
    server, url = _start(loop, backend, api_key=KEY, max_concurrency=3, read_timeout_s=1.0)
    body = json.dumps({"model": MODEL, "prompt": [1], "max_tokens": 1}).encode() + b" " * 100
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    if part == "head":
        start, trickle = head, b"x-slow: " + b"a" * 100  # 20 s of header unless cut off
    else:
        start = head + (f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(body)}\r\n\r\n").encode()
        start, trickle = start + body[:1], body[1:]
    outs: list[dict] = [{}, {}]
    threads = [threading.Thread(target=_trickle, args=(server.port, start, trickle, out))
               for out in outs]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for out in outs:
            assert out["cut"], "a client trickling its request was never cut off"
            status_line, _, rest = out["answer"].partition(b"\r\n")
            assert b" 408 " in status_line and b"request_timeout" in rest
        response = _post(url, "/v1/completions", {"model": MODEL, "prompt": [1],
                                                  "max_tokens": 1})
        assert response.status_code == 200, response.text
    finally:
        loop.run(server.stop(1.0))
    assert backend.started_ids == [backend.started_ids[-1]]  # the trickled body never ran


def test_requests_count_under_their_key_s_tenant(loop):
    backend = FakeBackend()
    server, url = _start(loop, backend, api_key=KEY, priority_api_keys=("prio-key",))
    try:
        for key in (KEY, KEY, "prio-key"):
            response = _post(url, "/v1/completions", {"model": MODEL, "prompt": [1],
                                                      "max_tokens": 1}, key=key)
            assert response.status_code == 200, response.text
    finally:
        loop.run(server.stop(1.0))
    first, again, other = backend.tenants
    assert first is not None and first == again and other not in (None, first)
    assert KEY not in first and "prio-key" not in other  # a hash, never the key


def test_api_key_and_open_paths(fake):
    _, url = fake
    body = {"model": MODEL, "prompt": [1], "max_tokens": 1}
    for key in (None, "wrong"):
        response = _post(url, "/v1/completions", body, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == \
            "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}
                         ).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    models = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == MODEL == models["data"][0]["root"]  # never a path
    assert "/models/fake" not in json.dumps(models)


def test_mid_stream_failure_is_an_error_event_without_done(loop):
    backend = MidStreamFailure()
    server, url = _start(loop, backend)
    try:
        events = _events(_post(url, "/v1/completions", {"model": MODEL, "prompt": [1],
                                                        "max_tokens": 5, "stream": True},
                               key=None))
        assert events[0]["choices"][0]["text"] == "C"
        assert events[-1]["error"]["type"] == "server_error" and "[DONE]" not in events
        failed = _post(url, "/v1/completions", {"model": MODEL, "prompt": [1],
                                                "max_tokens": 5}, key=None)
        assert failed.status_code == 500 and "worker exploded" not in failed.text
    finally:
        loop.run(server.stop(1.0))


def test_no_chat_template_is_a_400_and_completions_still_serve(loop):
    server, url = _start(loop, FakeBackend())  # no PromptTools: no template
    try:
        chat = _post(url, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, key=None)
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "no_chat_template"
        assert _post(url, "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 1},
                     key=None).status_code == 200
    finally:
        loop.run(server.stop(1.0))


def test_client_disconnect_aborts_the_request(fake):
    backend, url = fake
    backend.token_delay_s = 0.05
    before = len(backend.aborted_ids)
    with httpx.stream("POST", url + "/v1/completions", timeout=10,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": [1], "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # the first token arrived: hang up
    wait_for(lambda: len(backend.aborted_ids) > before, 5, "the abort")
    assert backend.aborted_ids[-1].startswith("cmpl-")
    wait_for(lambda: backend.num_running == 0, 5, "the stream to stop")


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(),
                     st.text(max_size=8))
_bodies = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, "other", ""]) | _scalars,
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-3, 100), max_size=8),
                        _scalars),
    "messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bot"]),
         "content": st.text(max_size=10) | _scalars}), max_size=3), _scalars),
    "max_tokens": _scalars, "temperature": _scalars, "top_p": _scalars, "top_k": _scalars,
    "n": _scalars, "best_of": _scalars,
    "stop": st.one_of(_scalars, st.lists(st.text(max_size=3), max_size=3)),
    "stream": _scalars, "logprobs": _scalars, "top_logprobs": _scalars, "seed": _scalars,
    "stream_options": st.one_of(_scalars, st.fixed_dictionaries({"include_usage": _scalars})),
    "presence_penalty": _scalars, "stop_token_ids": st.lists(st.integers(-2, 70), max_size=3),
    "timeout": _scalars, "min_p": _scalars, "repetition_penalty": _scalars,
})


@pytest.fixture(scope="module")
def fuzz_client(served):
    """One client for every fuzzed body (a client per body costs more than the request:
    each builds its TLS context); its connection is kept open between bodies, as a real
    client's is, and taken again after a refusal."""
    with httpx.Client(base_url=served[1], headers={"authorization": f"Bearer {KEY}"},
                      timeout=10) as client:
        yield client


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_bodies, chat=st.booleans())
def test_fuzzed_bodies_never_5xx_or_hang(served, fuzz_client, body, chat):
    backend, _ = served
    backend.ready, backend.fail_with, backend.token_delay_s = True, None, 0.0
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
        body["max_tokens"] = 64  # keep each example short; validation is what is fuzzed
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = fuzz_client.post(path, content=json.dumps(body, allow_nan=True))
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    wait_for(lambda: backend.num_running == 0, 5, "nothing left running")


def test_https_and_mutual_tls(loop, tmp_path):
    import ssl

    from pdserve.router.auth import TLSConfig
    from pdserve.testing.certificates import make_test_certificates

    certs = make_test_certificates(tmp_path)
    body = {"model": MODEL, "prompt": [1], "max_tokens": 2}
    tls = TLSConfig.from_files(certs["server_cert"], certs["server_key"])
    server, _ = _start(loop, FakeBackend(), tls=tls)
    url = f"https://127.0.0.1:{server.port}"
    try:
        response = httpx.post(url + "/v1/completions", json=body,
                              verify=ssl.create_default_context(cafile=certs["ca"]))
        assert response.json()["choices"][0]["text"] == "CD"
        with pytest.raises(httpx.ConnectError):
            httpx.post(url + "/v1/completions", json=body)  # the system roots do not know it
    finally:
        loop.run(server.stop(1.0))
    mutual = TLSConfig.from_files(certs["server_cert"], certs["server_key"], certs["ca"])
    server, _ = _start(loop, FakeBackend(), tls=mutual)
    url = f"https://127.0.0.1:{server.port}"
    try:
        context = ssl.create_default_context(cafile=certs["ca"])
        context.load_cert_chain(certs["client_cert"], certs["client_key"])
        assert httpx.post(url + "/v1/completions", json=body, verify=context).status_code == 200
        for cert in (None, ("stranger_cert", "stranger_key")):
            context = ssl.create_default_context(cafile=certs["ca"])
            if cert:
                context.load_cert_chain(certs[cert[0]], certs[cert[1]])
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                httpx.post(url + "/v1/completions", json=body, verify=context).raise_for_status()
    finally:
        loop.run(server.stop(1.0))
