"""The preparation stage (``router.prepare``): one rule per test, called directly with a
FakeBackend and a caller, then through both front doors at once (real loopback gRPC and HTTP
over one FakeBackend): a priority refused the same way, max_tokens absent vs given, the tenant
from the key, errors naming each door's own field."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import httpx
import pytest

from pdserve.api import generation_pb2 as pb
from pdserve.api import generation_pb2_grpc
from pdserve.router.auth import Caller, tenant_of_key
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.errors import PermissionDeniedError, RequestValidationError
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.http_server import HttpServer
from pdserve.router.prepare import prepare
from pdserve.router.validation import MAX_PROMPT_CHARS_PER_TOKEN, ClientRequest
from pdserve.testing.fake_backend import FakeBackend, FakePromptTools
from pdserve.worker_api.sampling_params import SamplingParams

CONTEXT = 32
KEY, PRIORITY_KEY = "prepare-key", "prepare-priority-key"
PLAIN = Caller(may_prioritize=False, tenant="key-plain")
PRIORITIZED = Caller(may_prioritize=True, tenant="key-prio")


class CountingBackend(FakeBackend):
    """A FakeBackend that counts its tokenize calls (to see what is refused before them)."""

    def __init__(self) -> None:
        super().__init__(ModelSpec("m", max_context_tokens=CONTEXT, vocab_size=64))
        self.num_tokenized = 0

    async def tokenize(self, text: str) -> list[int]:
        self.num_tokenized += 1
        return await super().tokenize(text)


def incoming(prompt: str | list[int] = (1, 2, 3), max_tokens: int | None = None,
             **fields) -> ClientRequest:
    params = SamplingParams(**({} if max_tokens is None else {"max_tokens": max_tokens}),
                            priority=fields.pop("priority", 0))
    prompt = prompt if isinstance(prompt, str) else list(prompt)
    return ClientRequest("label-1", prompt, params, max_tokens, **fields)


def prepared(request: ClientRequest, caller: Caller | None = PLAIN,
             backend: FakeBackend | None = None) -> PreparedRequest:
    return asyncio.run(prepare(backend or CountingBackend(), request, caller))


# -- the rules, one by one ----------------------------------------------------------------------
def test_a_priority_below_zero_needs_a_caller_that_may_ask_it():
    for caller in (None, PLAIN):
        with pytest.raises(PermissionDeniedError) as info:
            prepared(incoming(priority=-1), caller)
        assert info.value.field == "priority" and "priority key" in str(info.value)
    assert prepared(incoming(priority=-1), PRIORITIZED).params.priority == -1
    assert prepared(incoming(priority=3), None).params.priority == 3


def test_the_priority_is_refused_before_the_prompt_is_looked_at():
    backend = CountingBackend()
    for prompt in ("ABC", [999], []):  # tokenizable, out of vocabulary, empty
        with pytest.raises(PermissionDeniedError):
            prepared(incoming(prompt, priority=-2), PLAIN, backend)
    assert backend.num_tokenized == 0


def test_the_tenant_is_the_key_s_and_a_claim_counts_only_without_keys():
    assert prepared(incoming(claimed_tenant="someone-else"), PLAIN).tenant == "key-plain"
    assert prepared(incoming(claimed_tenant="team-a"), None).tenant == "team-a"
    assert prepared(incoming(), None).tenant is None
    with pytest.raises(RequestValidationError) as info:
        prepared(incoming(claimed_tenant="x" * 500), None)
    assert info.value.field == "tenant"


def test_an_absent_max_tokens_is_lowered_to_the_room_left():
    short = prepared(incoming([1] * 10))
    assert (short.max_tokens, short.params.max_tokens) == (None, 16)  # the default fits
    long = prepared(incoming([1] * 20))
    assert (long.max_tokens, long.params.max_tokens) == (None, CONTEXT - 20)


def test_a_given_max_tokens_is_kept_or_refused_naming_the_door_s_field():
    fits = prepared(incoming([1] * 19, max_tokens=13))
    assert (fits.max_tokens, fits.params.max_tokens) == (13, 13)
    with pytest.raises(RequestValidationError) as info:
        prepared(incoming([1] * 20, max_tokens=13, max_tokens_field="max_completion_tokens"))
    assert info.value.field == "max_completion_tokens"
    assert "exceeds the model's context of 32 tokens" in str(info.value)


def test_a_max_tokens_that_fills_the_context_is_refused_before_tokenizing():
    backend = CountingBackend()
    with pytest.raises(RequestValidationError) as info:
        prepared(incoming("ABC", max_tokens=CONTEXT, max_tokens_field="sampling.max_tokens"),
                 backend=backend)
    assert info.value.field == "sampling.max_tokens" and backend.num_tokenized == 0


def test_a_text_prompt_is_tokenized_by_the_backend():
    backend = CountingBackend()
    assert prepared(incoming("BCD"), backend=backend).prompt_token_ids == [1, 2, 3]
    assert backend.num_tokenized == 1


@pytest.mark.parametrize("prompt, tokenized", [
    ("", 0),  # empty text
    ([], 0),  # no ids
    ([1, 64], 0),  # an id outside the vocabulary
    ("A" * (MAX_PROMPT_CHARS_PER_TOKEN * CONTEXT + 1), 0),  # can never fit: not tokenized
    ([1] * CONTEXT, 0),  # fills the context: no room to generate
    ("A" * CONTEXT, 1),  # tokenized, then fills the context
], ids=["empty-text", "no-ids", "outside-vocab", "text-too-long", "ids-fill", "text-fills"])
def test_a_bad_prompt_is_refused_naming_the_door_s_field(prompt, tokenized):
    backend = CountingBackend()
    with pytest.raises(RequestValidationError) as info:
        prepared(incoming(prompt, prompt_field="messages"), backend=backend)
    assert info.value.field == "messages" and backend.num_tokenized == tokenized


def test_a_prepared_request_s_max_tokens_is_none_or_its_params():
    params = SamplingParams(max_tokens=5)
    with pytest.raises(ValueError, match="max_tokens"):
        PreparedRequest("x", [1], params, 6)
    with pytest.raises(ValueError, match="max_tokens"):
        ClientRequest("x", [1], params, 6)
    assert PreparedRequest("x", [1], params, None).max_tokens is None


# -- through both doors ---------------------------------------------------------------------------
class Doors:
    """A gRPC and an HTTP door over one FakeBackend with the same keys, on one loop."""

    def __init__(self, backend: FakeBackend, grpc_port: int, http_port: int) -> None:
        self.backend = backend
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=10)

    async def grpc(self, key: str, **fields) -> list[pb.GenerateResponse] | grpc.aio.AioRpcError:
        sampling = pb.SamplingParams(**fields.pop("sampling", {}))
        request = pb.GenerateRequest(sampling=sampling, **fields)
        try:
            return [r async for r in self.stub.Generate(
                request, metadata=(("authorization", f"Bearer {key}"),))]
        except grpc.aio.AioRpcError as exc:
            return exc

    async def post(self, key: str, path: str, body: dict) -> httpx.Response:
        return await self.http.post(path, json={"model": "fake-counter", **body},
                                    headers={"authorization": f"Bearer {key}"})


@contextlib.asynccontextmanager
async def doors():
    backend = FakeBackend()
    keys = {"api_key": KEY, "priority_api_keys": (PRIORITY_KEY,)}
    grpc_server = GenerationServer(backend, health_poll_interval_s=0.02, **keys)
    http_server = HttpServer(backend, tools=FakePromptTools(backend), **keys)
    both = Doors(backend, await grpc_server.start("127.0.0.1", 0),
                 await http_server.start("127.0.0.1", 0))
    try:
        yield both
    finally:
        await both.http.aclose()
        await both.channel.close()
        await http_server.stop(1.0)
        await grpc_server.stop(0)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_both_doors_refuse_a_priority_the_same_way_whatever_else_is_wrong():
    """The priority is decided before the prompt on both doors: an out-of-vocabulary prompt
    from a caller without a priority key is the same refusal, not a 400 on one door and a
    PERMISSION_DENIED on the other."""
    async def body():
        async with doors() as d:
            error = await d.grpc(KEY, token_ids=pb.TokenIds(ids=[999]),
                                 sampling={"priority": -1})
            response = await d.post(KEY, "/v1/completions", {"prompt": [999], "priority": -1})
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert response.status_code == 403, response.text
            refusal = response.json()["error"]
            assert refusal["param"] == "priority" and refusal["code"] == "priority_not_allowed"
            assert refusal["message"] == error.details()
            assert d.backend.started == []
    run(body())


def test_both_doors_hand_max_tokens_absent_as_none_and_given_as_given():
    async def body():
        async with doors() as d:
            assert not isinstance(await d.grpc(KEY, token_ids=pb.TokenIds(ids=[1])), Exception)
            await d.grpc(KEY, token_ids=pb.TokenIds(ids=[1]), sampling={"max_tokens": 5})
            assert (await d.post(KEY, "/v1/completions", {"prompt": [1]})).status_code == 200
            await d.post(KEY, "/v1/completions", {"prompt": [1], "max_tokens": 5})
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            await d.post(KEY, "/v1/chat/completions", chat)
            await d.post(KEY, "/v1/chat/completions", {**chat, "max_completion_tokens": 5})
            started = d.backend.started
            assert [r.max_tokens for r in started] == [None, 5, None, 5, None, 5]
            assert [r.params.max_tokens for r in started[:4]] == [16, 5, 16, 5]
            context = d.backend.model.max_context_tokens  # chat: all the room left
            assert started[4].params.max_tokens == context - len(started[4].prompt_token_ids)
    run(body())


def test_both_doors_count_a_key_s_requests_under_its_tenant():
    async def body():
        async with doors() as d:
            await d.grpc(KEY, token_ids=pb.TokenIds(ids=[1]), tenant="someone-else",
                         sampling={"max_tokens": 1})
            await d.post(KEY, "/v1/completions", {"prompt": [1], "max_tokens": 1})
            await d.grpc(PRIORITY_KEY, token_ids=pb.TokenIds(ids=[1]),
                         sampling={"max_tokens": 1})
            assert d.backend.tenants == [tenant_of_key(KEY)] * 2 + [tenant_of_key(PRIORITY_KEY)]
    run(body())


def test_a_max_tokens_that_does_not_fit_is_named_as_each_door_spells_it():
    async def body():
        async with doors() as d:
            prompt = [1] * 200  # of a context of 256
            error = await d.grpc(KEY, token_ids=pb.TokenIds(ids=prompt),
                                 sampling={"max_tokens": 57})
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith("sampling.max_tokens: prompt (200 tokens)")
            completion = await d.post(KEY, "/v1/completions",
                                      {"prompt": prompt, "max_tokens": 57})
            chat = await d.post(KEY, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "A" * 200}],
                "max_completion_tokens": 57})
            for response, param in ((completion, "max_tokens"),
                                    (chat, "max_completion_tokens")):
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == param and error["message"].startswith(f"{param}: ")
            long = await d.post(KEY, "/v1/completions", {"prompt": [1] * 256})
            assert long.json()["error"]["message"].startswith("prompt: prompt has 256 tokens")
            assert d.backend.started == []
    run(body())
