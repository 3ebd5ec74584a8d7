"""No request can hurt another's, on a real cluster (Ray + Redis + 1 prefill + 1 decode worker,
gRPC and OpenAI HTTP): a property-based fuzz over every field of both front doors with the
values hostile clients send (0, -1, 2**31, 2**63, 10**30, NaN, inf, huge strings and lists),
while ordinary greedy streams run beside it. Every answer is a success or a client error (HTTP
4xx with the OpenAI envelope; gRPC INVALID_ARGUMENT or RESOURCE_EXHAUSTED), the ordinary
streams finish with the offline engine's tokens, no worker restarts, no engine loop dies and
every block comes back."""

from __future__ import annotations

import contextlib
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.api import generation_pb2 as pb
from pdserve.api import generation_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HOSTILE_NUMBERS = [0, -1, 1, 2, 2**31, 2**31 - 1, 2**63, 2**63 - 1, -(2**63), 10**30, 2**200,
                   0.5, 1e-30, 1e30, -1e30, math.nan, math.inf, -math.inf]
HOSTILE_VALUES = HOSTILE_NUMBERS + [None, True, False, "", "x" * 5000, [], [1] * 5000,
                                    ["x"] * 500, {"a": 1}, [10**30], [-1]]
# (bodies may also hold NaN and Infinity: json.dumps writes them, and many clients do)
SAMPLING_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                   "stop", "stop_token_ids", "ignore_eos", "logprobs", "priority", "timeout",
                   "n", "best_of", "user", "logit_bias", "stream"]
CHAT_FIELDS = ["max_completion_tokens", "top_logprobs", "tools", "tool_choice",
               "parallel_tool_calls", "response_format", "logprobs", "add_generation_prompt"]
INT64 = [0, -1, 1, 2**31, 2**63 - 1, -(2**63), 10**12]
DOUBLES = [0.0, -1.0, 0.5, 1e-300, 1e30, -1e30, math.nan, math.inf, -math.inf]




@pytest.fixture(scope="module")
def cluster(start_cluster, chat_model):
    cluster = start_cluster(chat_model, http_port=0)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def http():
    """One HTTP client for the module (thread-safe; a client per request would cost more
    than most requests: each builds its TLS context)."""
    with httpx.Client(timeout=60) as client:
        yield client


class Bystanders:
    """Rounds of ordinary greedy streams on a thread while the fuzz runs; every round's tokens
    are checked against the offline engine."""

    def __init__(self, e2e, cluster, model_dir):
        self.prompts = e2e.prompts(seed=26, n=4, low=8, high=30)
        self.expected = e2e.reference(model_dir, self.prompts, 48)
        self.e2e, self.target = e2e, cluster.target
        self.rounds, self.wrong = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            results = self.e2e.generate_all(self.target, self.prompts, 48)
            got = [r.token_ids for r in results]
            if got != self.expected:
                self.wrong.append(got)
            self.rounds += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(120)


def restarts(http: httpx.Client, cluster) -> float:
    text = http.get(cluster.metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_worker_restarts_total"))


def post(http: httpx.Client, url: str, path: str, body: dict) -> httpx.Response:
    raw = json.dumps(body)  # (NaN and Infinity as Python writes them)
    return http.post(url + path, content=raw, headers={"content-type": "application/json"})


def check_http_answer(response: httpx.Response, body: dict) -> None:
    status = response.status_code
    if status == 504:  # only a request that asked for a (tiny) timeout may time out
        assert "timeout" in body, response.text
        return
    assert status < 500, f"{status} for {body!r}: {response.text[:500]}"
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def grpc_answer(stub, request) -> grpc.StatusCode:
    try:
        for _ in stub.Generate(request, timeout=60):
            pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def sampling_proto(values: dict) -> pb.SamplingParams:
    sampling = pb.SamplingParams()
    for name, value in values.items():
        if name in ("stop", "stop_token_ids"):
            getattr(sampling, name).extend(value)
        else:
            setattr(sampling, name, value)
    return sampling


def hostile_fields(names: list[str]):
    """One to three fields set to hostile values, the rest left valid (so the hostile value is
    what the server meets, not some other field's refusal)."""
    return st.dictionaries(st.sampled_from(names), st.sampled_from(HOSTILE_VALUES),
                           min_size=1, max_size=3)


VALID_COMPLETION = {"model": "qwen2-chat", "prompt": [5, 6, 7], "max_tokens": 4}
VALID_CHAT = {"model": "qwen2-chat", "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 4}
completion_bodies = st.builds(
    lambda prompt, fields: {**VALID_COMPLETION, **prompt, **fields},
    st.sampled_from([{}, {"prompt": "hello there"}, {"prompt": ["hi"]}, {"prompt": [[1, 2]]},
                     {"prompt": []}, {"prompt": ""}, {"prompt": [10**30]}, {"prompt": [-1]},
                     {"prompt": "x" * 70_000}, {"prompt": [1] * 3000}]),
    hostile_fields(SAMPLING_FIELDS + ["prompt", "model"]))
chat_bodies = st.builds(
    lambda messages, fields: {**VALID_CHAT, **messages, **fields},
    st.sampled_from([{}, {"messages": []},
                     {"messages": [{"role": "user", "content": "x" * 70_000}]},
                     {"messages": [{"role": "user", "content": ""}] * 3000},
                     {"messages": [{"role": "wizard", "content": "hi"}]},
                     {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
                     {"messages": [{"role": "assistant", "tool_calls": [
                         {"function": {"name": "f", "arguments": "x" * 70_000}}]}]},
                     {"messages": [{"role": "tool", "content": "1", "tool_call_id": 2**63}]},
                     {"tools": [{"type": "function", "function": {"name": "f",
                                 "parameters": {"type": "array", "minItems": 2**63}}}],
                      "tool_choice": "required"}]),
    hostile_fields(SAMPLING_FIELDS + CHAT_FIELDS + ["messages"]))
GRPC_VALUES = {  # what each proto field's type can carry
    **{name: INT64 for name in ("max_tokens", "top_k", "seed", "logprobs", "n", "best_of")},
    **{name: DOUBLES for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty")},
    "priority": [0, -1, 2**31 - 1, -(2**31)], "ignore_eos": [True, False],
    "stop": [[], [""], ["x" * 5000], ["a"] * 500],
    "stop_token_ids": [[], [-1], [2**63 - 1], [1] * 5000]}
GRPC_ANSWERS = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.RESOURCE_EXHAUSTED)
GRPC_MODELS = ["", "qwen2-chat", "nope", "x" * 5000, "\x00", "../../etc/passwd"]  # model
LORA_ADMIN_BODIES = [  # the adapter admin paths (this server runs without LoRA: 400 each)
    *({"lora_name": value, "lora_path": "/tmp"} for value in HOSTILE_VALUES),
    *({"lora_name": "a", "lora_path": value} for value in HOSTILE_VALUES),
    {"lora_name": "a", "lora_path": "/etc/passwd"}, {}]
grpc_sampling = st.dictionaries(st.sampled_from(sorted(GRPC_VALUES)), st.none(), min_size=1,
                                max_size=3).flatmap(
    lambda names: st.fixed_dictionaries({n: st.sampled_from(GRPC_VALUES[n]) for n in names}))
SWEEP_CLIENTS = 6  # the sweep's requests in flight at once
FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@contextlib.contextmanager
def harmless(cluster, chat_model, e2e, http):
    """A gRPC stub to send with, ordinary streams running beside it; afterwards every
    ordinary stream had the offline tokens, no worker restarted or died, no block is held."""
    before = restarts(http, cluster)
    channel = grpc.insecure_channel(cluster.target)
    try:
        with Bystanders(e2e, cluster, chat_model) as bystanders:
            yield pb_grpc.GenerationStub(channel)
    finally:
        channel.close()
    assert bystanders.rounds >= 1 and bystanders.wrong == []
    assert restarts(http, cluster) == before
    assert all(s.error is None for s in cluster.worker_stats().values())
    e2e.wait_idle(cluster)


def test_every_field_at_every_hostile_value(cluster, chat_model, e2e, http):
    """The sweep behind the fuzz: each sampling field alone at each hostile value, on both
    front doors, beside the ordinary streams; SWEEP_CLIENTS at a time, so they also arrive
    as a burst."""
    bodies = [{**VALID_COMPLETION, name: value}
              for name in SAMPLING_FIELDS for value in HOSTILE_VALUES]
    requests = []
    for name, values in GRPC_VALUES.items():
        for value in values:
            request = pb.GenerateRequest(sampling=sampling_proto({name: value}))
            request.token_ids.ids.extend([5, 6, 7])
            requests.append((name, value, request))
    with harmless(cluster, chat_model, e2e, http) as stub, \
            ThreadPoolExecutor(SWEEP_CLIENTS) as pool:
        def completion(body: dict) -> None:
            check_http_answer(post(http, cluster.http_url, "/v1/completions", body), body)

        def generate(item) -> None:
            name, value, request = item
            assert grpc_answer(stub, request) in GRPC_ANSWERS, (name, value)

        def model(value: str) -> None:
            request = pb.GenerateRequest(model=value)
            request.token_ids.ids.extend([5, 6, 7])
            request.sampling.max_tokens = 2
            assert grpc_answer(stub, request) in (*GRPC_ANSWERS, grpc.StatusCode.NOT_FOUND)

        def lora_admin(body: dict) -> None:
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                check_http_answer(post(http, cluster.http_url, path, body), body)

        list(pool.map(completion, bodies))  # (re-raises the first failed check)
        list(pool.map(generate, requests))
        list(pool.map(model, GRPC_MODELS))
        list(pool.map(lora_admin, LORA_ADMIN_BODIES))


def test_hostile_requests_harm_no_one(cluster, chat_model, e2e, http):
    with harmless(cluster, chat_model, e2e, http) as stub:
        @FUZZ
        @given(body=completion_bodies)
        def completions(body):
            check_http_answer(post(http, cluster.http_url, "/v1/completions", body), body)

        @FUZZ
        @given(body=chat_bodies)
        def chats(body):
            check_http_answer(post(http, cluster.http_url, "/v1/chat/completions", body),
                              body)

        @FUZZ
        @given(values=grpc_sampling, text=st.booleans())
        def generations(values, text):
            request = pb.GenerateRequest(sampling=sampling_proto(values))
            if text:
                request.text = "hello there"
            else:
                request.token_ids.ids.extend([5, 6, 7])
            code = grpc_answer(stub, request)
            assert code in GRPC_ANSWERS, (code, values)

        completions()
        chats()
        generations()


def router_gauge(http: httpx.Client, cluster, name: str) -> float:
    text = http.get(cluster.metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and 'role="router"' in line)


def test_one_request_id_through_both_doors_is_two_requests(cluster, chat_model, e2e, http):
    """The reported lock-out: the HTTP door hands a client its id in the first SSE chunk; the
    same id sent at once through the gRPC door used to overwrite the first request's entry in
    the router's flight table, so one stream hung to its deadline and its prompt tokens never
    came back to the budget. Labels are labels now: both streams finish with the offline
    engine's tokens, each gets the id back, and the router holds no request afterwards."""
    prompt_http, prompt_grpc = e2e.prompts(seed=44, n=2, low=20, high=30)
    expected = e2e.reference(chat_model, [prompt_http, prompt_grpc], 24)
    model = httpx.get(cluster.http_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt_http, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.http_url + "/v1/completions", json=body,
                      timeout=60) as response:
        events = (line[len("data: "):] for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]")
        first = json.loads(next(events))
        label = first["id"]
        with grpc.insecure_channel(cluster.target) as channel:  # the same id, other door
            request = pb.GenerateRequest(request_id=label, sampling=pb.SamplingParams(
                max_tokens=24, temperature=0.0, ignore_eos=True))
            request.token_ids.ids.extend(prompt_grpc)
            chunks = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
        http_chunks = [first] + [json.loads(e) for e in events]
    assert chunks[0].request_id == label
    assert [t for c in chunks for t in c.token_ids] == expected[1]
    assert chunks[-1].finish_reason == "length"
    assert {c["id"] for c in http_chunks} == {label}
    assert http_chunks[-1]["choices"][0]["finish_reason"] == "length"
    in_flight = "pdserve_router_requests_in_flight"
    assert e2e.wait_for(lambda: router_gauge(http, cluster, in_flight) == 0, 30,
                        "the router to hold no request")
