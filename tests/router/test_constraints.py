"""The router's check of structured outputs (``router.constraints``, step 6 of
``router.prepare``): a real grammar compiler in a child process over the tiny model's
tokenizer. A constraint that does not compile, or not within the deadline, is refused before
any worker sees it, naming the field as each door spells it (gRPC INVALID_ARGUMENT, HTTP 400);
the event loop goes on while a compile runs; hostile and random constraints are answered,
never hang the checker; with real workers behind the router core, the trace and the metrics
say where each constraint was compiled and where a cache held it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import grpc
import httpx
import pytest

from pdserve.api import generation_pb2 as pb
from pdserve.api import generation_pb2_grpc
from pdserve.engine.config import EngineConfig
from pdserve.models import Tokenizer
from pdserve.router.backend import ModelSpec
from pdserve.router.constraints import ConstraintCheck, ConstraintChecker, ConstraintRefused
from pdserve.router.core import Router, RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.router.errors import RequestValidationError
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.http_server import HttpServer
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prepare import prepare
from pdserve.router.validation import ClientRequest
from pdserve.testing.fake_backend import FakeBackend, FakePromptTools
from pdserve.worker_api.sampling_params import (
    MAX_REGEX_DEPTH,
    MAX_SCHEMA_DEPTH,
    SamplingParams,
    StructuredOutputs,
)
from pdserve.workers.build import build_local_workers

VOCAB = 512  # the tiny model's
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# 500 optional properties: fine for a worker (well under a second), far past a 50 ms deadline
SLOW_SCHEMA = {"type": "object",
               "properties": {f"field{i}": {"type": "integer"} for i in range(500)}}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_hf_folder(tiny_dir)


def outputs(**kind) -> StructuredOutputs:
    return StructuredOutputs.of(kind)


def test_a_constraint_is_compiled_once_then_answered_from_the_cache(tokenizer):
    async def body():
        checker = ConstraintChecker(tokenizer, VOCAB)
        try:
            first = await checker.check(outputs(json=SCHEMA))
            again = await checker.check(outputs(json=dict(SCHEMA)))  # equal: one key
            assert not first.cached and first.compile_s > 0
            assert again == ConstraintCheck(0.0, True)
            for bad in (outputs(grammar="root ::= undefined_rule"),
                        outputs(json={"type": "no-such-type"}), outputs(regex="(ab")):
                for _ in range(2):  # refused again from the cache
                    with pytest.raises(ConstraintRefused, match="^does not compile: "):
                        await checker.check(bad)
        finally:
            checker.close()
    run(body())


def test_a_compile_past_the_deadline_is_refused_and_the_loop_goes_on(tokenizer):
    async def body():
        checker = ConstraintChecker(tokenizer, VOCAB, timeout_s=0.05)
        try:
            await checker.check(outputs(regex="warm-up"))  # (the child's start is not timed)
            ticks = 0
            check = asyncio.ensure_future(checker.check(outputs(json=SLOW_SCHEMA)))
            while not check.done():
                ticks += 1
                await asyncio.sleep(0.001)
            with pytest.raises(ConstraintRefused) as info:
                await check
            assert info.value.is_too_complex
            assert str(info.value) == "is too complex: it did not compile within 0.05 s"
            assert ticks > 1  # the loop ran while the child compiled
            # the child was killed; a new one takes the next constraint
            assert not (await checker.check(outputs(json=SCHEMA))).cached
        finally:
            checker.close()
    run(body())


def test_a_compiler_that_cannot_start_leaves_the_check_to_the_workers(caplog):
    """No tokenizer table can be built (the child exits while starting): the router logs it
    and lets the request on, unchecked; its workers' own compile still refuses a bad one."""
    async def body():
        checker = ConstraintChecker(None, VOCAB)  # (GrammarCompiler fails on it in the child)
        try:
            assert await checker.check(outputs(regex="a")) == ConstraintCheck(0.0, False)
        finally:
            checker.close()
    run(body())
    assert "structured output not checked in the router" in caplog.text


class CheckingBackend(FakeBackend):
    """A FakeBackend whose constraints a real ConstraintChecker checks (as the router's)."""

    def __init__(self, checker: ConstraintChecker) -> None:
        super().__init__(ModelSpec("fake-counter", 256, VOCAB))
        self.checker = checker
        self.metrics = RouterMetrics()

    async def check_constraint(self, outputs: StructuredOutputs) -> ConstraintCheck | None:
        try:
            check = await self.checker.check(outputs)
        except ConstraintRefused as exc:
            self.metrics.observe_constraint_check(exc.check, exc)
            raise
        self.metrics.observe_constraint_check(check, None)
        return check


@contextlib.asynccontextmanager
async def doors(tokenizer: Tokenizer, timeout_s: float):
    backend = CheckingBackend(ConstraintChecker(tokenizer, VOCAB, timeout_s))
    grpc_server = GenerationServer(backend, health_poll_interval_s=0.02)
    http_server = HttpServer(backend, tools=FakePromptTools(backend))
    grpc_port = await grpc_server.start("127.0.0.1", 0)
    http_port = await http_server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=60)
    try:
        yield backend, generation_pb2_grpc.GenerationStub(channel), http
    finally:
        await http.aclose()
        await channel.close()
        await http_server.stop(1.0)
        await grpc_server.stop(0)
        backend.checker.close()


def _deep(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


# (HTTP body's constraint, gRPC StructuredOutputs fields, HTTP param, gRPC field, message)
REFUSED = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     {"json": '{"type": "no-such-type"}'}, "response_format.json_schema.schema",
     "sampling.structured_outputs.json", "does not compile"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, {"grammar": "root ::= ("},
     "structured_outputs.grammar", "sampling.structured_outputs.grammar", "does not compile"),
    ({"structured_outputs": {"regex": "a{3,1}"}}, {"regex": "a{3,1}"},
     "structured_outputs.regex", "sampling.structured_outputs.regex", "does not compile"),
    ({"structured_outputs": {"json": SLOW_SCHEMA}}, {"json": json.dumps(SLOW_SCHEMA)},
     "structured_outputs.json", "sampling.structured_outputs.json", "is too complex"),
    # bounded in size before compiling (StructuredOutputs' own checks, at the door)
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": _deep(MAX_SCHEMA_DEPTH)}}},
     {"json": json.dumps(_deep(MAX_SCHEMA_DEPTH))},
     "response_format.json_schema.schema", "sampling.structured_outputs.json", "nests more"),
    ({"structured_outputs": {"json": '{"a":' * 5000 + "1" + "}" * 5000}},
     {"json": '{"a":' * 5000 + "1" + "}" * 5000}, "structured_outputs.json",
     "sampling.structured_outputs.json", "nests more"),
    ({"structured_outputs": {"json": {"enum": [f"v{i}" for i in range(5000)]}}},
     {"json": json.dumps({"enum": [f"v{i}" for i in range(5000)]})},
     "structured_outputs.json", "sampling.structured_outputs.json", "enum and const values"),
    ({"structured_outputs": {"regex": "(" * (MAX_REGEX_DEPTH + 1) + "a"
                             + ")" * (MAX_REGEX_DEPTH + 1)}},
     {"regex": "(" * (MAX_REGEX_DEPTH + 1) + "a" + ")" * (MAX_REGEX_DEPTH + 1)},
     "structured_outputs.regex", "sampling.structured_outputs.regex", "nests more"),
]


def test_both_doors_refuse_a_bad_or_slow_constraint_naming_their_field(tokenizer):
    async def body():
        async with doors(tokenizer, timeout_s=0.05) as (backend, stub, http):
            await backend.checker.check(outputs(regex="warm-up"))
            for http_body, fields, param, grpc_field, message in REFUSED:
                response = await http.post("/v1/completions", json={
                    "model": "fake-counter", "prompt": [1, 2], **http_body})
                assert response.status_code == 400, (param, response.text)
                error = response.json()["error"]
                assert error["param"] == param and error["type"] == "invalid_request_error"
                assert message in error["message"], error
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]),
                                             sampling=pb.SamplingParams(
                                                 structured_outputs=pb.StructuredOutputs(
                                                     **fields)))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [r async for r in stub.Generate(request)]
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, grpc_field
                assert info.value.details().startswith(f"{grpc_field}: "), info.value.details()
                assert message in info.value.details()
            assert backend.started == []  # no worker saw any of them
            fine = await http.post("/v1/completions", json={
                "model": "fake-counter", "prompt": [1, 2],
                "structured_outputs": {"regex": "(a+)+$"}})  # catastrophic for backtracking
            assert fine.status_code == 200, fine.text  # (an automaton compiles it at once)
            assert len(backend.started) == 1
            assert backend.started[0].constraint_check == ConstraintCheck(
                backend.started[0].constraint_check.compile_s, False)
            sample = backend.metrics.registry.get_sample_value
            # each refused constraint compiled for the first door, cached for the second
            assert sample("pdserve_structured_output_invalid_requests_total",
                          {"reason": "too_complex"}) == 2
            assert sample("pdserve_structured_output_invalid_requests_total",
                          {"reason": "does_not_compile"}) == 6
            assert sample("pdserve_structured_output_cache_hits_total") == 4
            assert sample("pdserve_structured_output_compiles_total") == 5
    run(body())


def _random_text(rng: random.Random, alphabet: str) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))


def test_random_constraints_are_compiled_or_refused_never_stuck(tokenizer):
    """Fuzz: random regexes, grammars and schemas each get an answer (compiled, or refused
    saying why) and the checker goes on answering after all of them."""
    rng = random.Random(46)
    candidates = []
    for _ in range(60):
        candidates.append({"regex": _random_text(rng, "ab()[]{}|*+?.^$\\-,0123")})
        candidates.append({"grammar": "root ::= " + _random_text(rng, 'ab"()|*+? :=[]')})
        kind = rng.choice(["object", "array", "string", "integer", "nope", 7])
        candidates.append({"json": {"type": kind, "minLength": rng.randint(-2, 5),
                                    "pattern": _random_text(rng, "ab()[]*+?{}1,"),
                                    "items": {"enum": [rng.randint(0, 3)]}}})

    async def body():
        checker = ConstraintChecker(tokenizer, VOCAB, timeout_s=5.0)
        try:
            answers = {"compiled": 0, "refused": 0}
            for fields in candidates:
                try:
                    constraint = StructuredOutputs.of(fields)
                except ValueError:
                    continue  # refused on shape (e.g. a bad regex group count)
                try:
                    await checker.check(constraint)
                    answers["compiled"] += 1
                except ConstraintRefused as exc:
                    assert str(exc).startswith(("does not compile: ", "is too complex")), exc
                    answers["refused"] += 1
            assert answers["compiled"] and answers["refused"], answers
            assert not (await checker.check(outputs(json=SCHEMA))).cached
        finally:
            checker.close()
    run(body())


def test_a_router_checks_then_its_workers_compile_and_the_trace_says_so(hf_checkpoint):
    """The router core with a prefill and a decode worker in this process: a constrained
    request's trace holds the router's check and each worker's compile; the same constraint
    again is a hit everywhere; a bad one is refused before any worker sees it."""
    model_dir = hf_checkpoint("llama")
    config = EngineConfig(model=str(model_dir), dtype="float32", block_size=4,
                          num_kv_blocks=96, max_num_batched_tokens=32)

    async def body():
        handles = build_local_workers(config, num_prefill=1, num_decode=1)
        checker = ConstraintChecker(Tokenizer.from_hf_folder(model_dir), VOCAB)
        router = Router(ModelSpec("t", 256, VOCAB, ()), StaticDirectory(handles),
                        tokenize=list, config=RouterConfig(disaggregation="always"),
                        constraints=checker)
        await router.start()
        try:
            params = SamplingParams(max_tokens=20, temperature=0.0,
                                    structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"})
            for _ in range(2):
                prepared = await prepare(router, ClientRequest("x", [5, 6, 7], params, 20),
                                         None)
                async for _delta in router.generate(prepared):
                    pass
            first, second = list(router.traces)[-2:]
            assert first.finish_reason == second.finish_reason == "stop"
            assert first.grammar_cache_hit is False and first.grammar_compile_s > 0
            assert first.prefill_grammar_cache_hit is False
            assert first.decode_grammar_cache_hit is False
            assert first.prefill_grammar_compile_s > 0 and first.decode_grammar_compile_s > 0
            assert (second.grammar_cache_hit, second.prefill_grammar_cache_hit,
                    second.decode_grammar_cache_hit) == (True, True, True)
            bad = SamplingParams(max_tokens=4, structured_outputs={"grammar": "root ::= ("})
            with pytest.raises(RequestValidationError) as info:
                await prepare(router, ClientRequest("y", [5], bad, 4,
                                                    constraint_field="sampling.x"), None)
            assert info.value.field == "sampling.x"
            sample = router.metrics.registry.get_sample_value
            assert sample("pdserve_structured_output_compiles_total") == 2
            assert sample("pdserve_structured_output_cache_hits_total") == 1
            assert sample("pdserve_structured_output_compile_seconds_count") == 2
        finally:
            await router.stop()
            for handle in handles:
                handle.close()
    run(body())
