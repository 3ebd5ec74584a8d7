"""The OpenAI HTTP front door and the secure defaults on a real cluster (Ray + Redis + 1P1D),
started with an API key and TLS: the official ``openai`` package for completions and chat,
stream and not, greedy text equal to the offline engine, the usage chunk rules, the error
envelope, a disconnect that frees every block, gRPC behind the same key, every listening
socket on loopback, hostile joins to the decode worker's KV rendezvous, prefix-cache hits with
the cluster's salted hashes."""

from __future__ import annotations

import datetime
import json
import re
import ssl

import grpc
import httpx
import jsonschema
import openai
import psutil
import pytest

from pdserve.api.client import ClientTLS, PdserveClient, PdserveError
from pdserve.router.config import RouterConfig
from pdserve.testing.certificates import make_test_certificates

pytestmark = pytest.mark.e2e

KEY = "e2e-secret-key"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}




@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def cluster(start_cluster, chat_model, certs):
    cluster = start_cluster(chat_model, http_port=0, api_key=KEY, tls_cert=certs["server_cert"],
                            tls_key=certs["server_key"],  # prompts on the prefill worker:
                            router=RouterConfig(disaggregation="always"))  # its prefix cache
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def verify(certs):
    return ssl.create_default_context(cafile=certs["ca"])


@pytest.fixture(scope="module")
def client(cluster, verify):
    http = httpx.Client(verify=verify, timeout=60)
    yield openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=KEY, http_client=http,
                        max_retries=0)
    http.close()


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def _offline(model_dir, prompt_ids, max_tokens, **sampling):
    from pdserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=256)
    params = SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, "ignore_eos": True,
                                                      **sampling})
    out = llm.generate([prompt_ids], params, use_tqdm=False)[0]
    return out.token_ids, out.text


def test_models_and_greedy_completions_match_the_offline_engine(cluster, client, model_name,
                                                               chat_model):
    models = client.models.list().data
    assert models[0].id == "qwen2-chat" == models[0].root  # the name, never the folder
    prompt = list(range(20, 45))
    ids, text = _offline(chat_model, prompt, 12)
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == text and out.usage.completion_tokens == len(ids) == 12
    assert out.choices[0].finish_reason == "length" and out.usage.prompt_tokens == len(prompt)
    chunks = list(client.completions.create(
        model=model_name, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_stream_and_not(client, model_name):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_error_envelope(cluster, client, model_name, verify):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt=[1, 2], temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=[1, 2])
    wrong = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="wrong", max_retries=0,
                          http_client=httpx.Client(verify=verify))
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    slow = httpx.post(cluster.http_url + "/v1/completions", verify=verify, timeout=30,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"model": model_name, "prompt": [3, 4, 5], "max_tokens": 400,
                            "ignore_eos": True, "timeout": 0.001})
    assert slow.status_code == 504, slow.text
    assert slow.json()["error"]["code"] == "deadline_exceeded"
    assert httpx.get(cluster.http_url + "/health", verify=verify).status_code == 200


WEATHER = {"type": "object", "properties": {
    "sky": {"enum": ["clear", "cloudy", "rain"]}, "windy": {"type": "boolean"},
    "station": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["sky", "windy", "station"], "additionalProperties": False}


def test_structured_output_holds_across_the_kv_hand_off(cluster, client, model_name, e2e,
                                                        chat_model):
    """Every prompt here is prefilled on the prefill worker, whose token 0 obeys the
    constraint; the decode worker replays it into its own matcher and goes on. The model's
    weights are random, so an answer that parses and matches is the grammar's doing."""
    import typing

    import pydantic

    class Weather(pydantic.BaseModel):  # what the official client's parse() sends and reads
        sky: typing.Literal["clear", "cloudy", "rain"]
        windy: bool
        station: str = pydantic.Field(pattern="^[A-Z]{3}$")

    messages = [{"role": "user", "content": "What is the weather at the station?"}]
    for temperature in (0.0, 1.0):
        parsed = client.chat.completions.parse(model=model_name, messages=messages,
                                               max_tokens=80, temperature=temperature, seed=4,
                                               response_format=Weather)
        assert isinstance(parsed.choices[0].message.parsed, Weather)
        answer = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=80, temperature=temperature,
            seed=3, response_format={"type": "json_schema",
                                     "json_schema": {"name": "weather", "schema": WEATHER}})
        choice = answer.choices[0]
        value = json.loads(choice.message.content)
        assert value["sky"] in ("clear", "cloudy", "rain") and isinstance(value["windy"], bool)
        assert re.fullmatch("[A-Z]{3}", value["station"]) and choice.finish_reason == "stop"
    prompt = list(range(60, 90))
    _, text = _offline(chat_model, prompt, 80, ignore_eos=False,
                       structured_outputs={"json": WEATHER})
    served = client.completions.create(model=model_name, prompt=prompt, max_tokens=80,
                                       temperature=0, extra_body={"structured_outputs": {
                                           "json": WEATHER}})
    assert served.choices[0].text == text  # greedy under a constraint: the offline engine's
    chunks = list(client.completions.create(
        model=model_name, prompt="code:", max_tokens=40, temperature=1.0, seed=5, stream=True,
        extra_body={"structured_outputs": {"regex": "[a-f]{4}-[0-9]{3}"}}))
    assert re.fullmatch("[a-f]{4}-[0-9]{3}", "".join(c.choices[0].text for c in chunks))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="x", max_tokens=4, extra_body={
            "structured_outputs": {"json": {"properties": {"a": {"$ref": "#/$defs/none"}}}}})
    # refused by the router's own compile, before any worker saw it
    assert err.value.body["param"] == "structured_outputs.json"
    assert err.value.body["message"].startswith("structured_outputs.json: does not compile")
    assert e2e.wait_idle(cluster)


WINDY = {"type": "object", "properties": {"windy": {"type": "boolean"}},
         "required": ["windy"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WINDY}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]


def _check_call(call):
    schema = {"get_weather": WINDY, "get_time": CLOCK}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    assert call.type == "function" and call.id.startswith("call_")


def test_tool_calls_round_trip_across_the_kv_hand_off(cluster, client, model_name, e2e):
    """A named function and ``required`` are forced by a grammar; ``auto`` is read by the
    Hermes parser the template names (here the model is made to write a Hermes call by a
    regex, since its random weights never would). Each answer's calls validate against
    their function's schema, streamed the same as whole, and the tool's result goes back
    through the template for the next answer."""
    tools = TOOLS  # short: the tools' JSON takes ~300 of the pool's 512 token slots
    ask = [{"role": "user", "content": "Is it windy at the station?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=model_name, messages=ask, tools=tools,
                                           tool_choice=named, max_tokens=80, temperature=0)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "stop"
    _check_call(call)
    chunks = list(client.chat.completions.create(model=model_name, messages=ask, tools=tools,
                                                 tool_choice=named, max_tokens=80,
                                                 temperature=0, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    for seed in range(3):
        required = client.chat.completions.create(
            model=model_name, messages=ask, tools=tools, tool_choice="required",
            parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=seed)
        assert required.choices[0].finish_reason == "tool_calls"
        assert len(required.choices[0].message.tool_calls) == 1
        _check_call(required.choices[0].message.tool_calls[0])
    hermes = {"regex": r'Checking\.<tool_call>\{"name":"get_time","arguments":'
                       r'\{"zone":"(UTC|CET)"\}\}</tool_call>'}
    auto = client.chat.completions.create(model=model_name, messages=ask, tools=tools,
                                          max_tokens=80, temperature=1.0, seed=4,
                                          extra_body={"structured_outputs": hermes})
    answer = auto.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content == "Checking."
    _check_call(answer.message.tool_calls[0])
    chunks = list(client.chat.completions.create(
        model=model_name, messages=ask, tools=tools, max_tokens=80, temperature=1.0, seed=4,
        stream=True, extra_body={"structured_outputs": hermes}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    streamed = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in streamed] == \
        [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = ask + [whole.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": '{"windy": true}'}]
    reply = client.chat.completions.create(  # "none": the tools are not shown again
        model=model_name, messages=history, tools=tools, tool_choice="none", max_tokens=6,
        temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(model=model_name, messages=ask, max_tokens=1)
    assert reply.choices[0].message.tool_calls is None
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens + 40  # the call, its result
    assert e2e.wait_idle(cluster)


def test_logit_bias_holds_across_the_kv_hand_off(cluster, client, model_name, chat_model, certs,
                                                 e2e):
    """Token 0 is sampled on the prefill worker, the rest on the decode worker: +100 forces a
    token at every position; banning each greedy choice gives the offline engine's tokens
    under the same ban (so both workers applied it)."""
    from pdserve import LLM, SamplingParams

    prompt = list(range(50, 70))
    forced = client.completions.create(model=model_name, prompt=prompt, max_tokens=6,
                                       temperature=0, logprobs=0, logit_bias={"321": 100},
                                       extra_body={"ignore_eos": True})
    tokens = forced.choices[0].logprobs.tokens
    assert len(tokens) == 6 and len(set(tokens)) == 1
    free_ids, _ = _offline(chat_model, prompt, 6)
    ban = {token: -100.0 for token in free_ids[:3]}
    llm = LLM(str(chat_model), dtype="float32", block_size=4, num_kv_blocks=256)
    expected = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True, logit_bias=ban),
                            use_tqdm=False)[0]
    assert set(expected.token_ids).isdisjoint(ban)
    banned = client.completions.create(model=model_name, prompt=prompt, max_tokens=6,
                                       temperature=0, logit_bias={str(t): b for t, b in
                                                                  ban.items()},
                                       extra_body={"ignore_eos": True})
    assert banned.choices[0].text == expected.text
    with PdserveClient(cluster.target, timeout=30, tls=ClientTLS.from_files(ca=certs["ca"]),
                       api_key=KEY) as grpc_client:
        result = grpc_client.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True,
                                      logit_bias={321: 100.0})
    assert result.token_ids == [321] * 6
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                  logit_bias={"10000000": 1})
    assert err.value.body["param"] == "logit_bias"
    assert e2e.wait_idle(cluster)


def test_echo_and_prompt_logprobs_come_back_from_the_prefill_worker(cluster, client, model_name,
                                                                   chat_model, certs, e2e):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 0) on the 1P1D cluster:
    the prefill worker scores the prompt (its prefix cache skipped) and the scores ride to the
    router with token 0; they equal the offline engine's (tied to Hugging Face there)."""
    from pdserve import LLM, SamplingParams

    prompt = list(range(30, 78))  # more than one 32-token step: chunked on the prefill worker
    llm = LLM(str(chat_model), dtype="float32", block_size=4, num_kv_blocks=256)
    expected = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                     prompt_logprobs=1), use_tqdm=False)[0]
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache
        out = client.completions.create(model=model_name, prompt=prompt, max_tokens=0,
                                        echo=True, logprobs=1, temperature=0)
        lp = out.choices[0].logprobs
        assert out.usage.completion_tokens == 0 and len(lp.tokens) == len(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i, value in enumerate(lp.token_logprobs[1:], 1):
            assert abs(value - expected.prompt_logprobs[i][prompt[i]]) < 1e-4, i
    with PdserveClient(cluster.target, timeout=30, tls=ClientTLS.from_files(ca=certs["ca"]),
                       api_key=KEY) as grpc_client:
        result = grpc_client.generate(prompt, max_tokens=3, temperature=0, prompt_logprobs=2)
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(result.prompt_logprobs[1:], 1):
        assert abs(entry.logprob - expected.prompt_logprobs[i][prompt[i]]) < 1e-4, i
        assert len(entry.top) == 2
    assert e2e.wait_idle(cluster)


def test_disconnect_frees_every_block(cluster, model_name, verify, e2e):
    with httpx.stream("POST", cluster.http_url + "/v1/completions", verify=verify, timeout=60,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"model": model_name, "prompt": list(range(30, 60)),
                            "max_tokens": 400, "ignore_eos": True, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                break  # first token: hang up mid-stream
    assert e2e.wait_idle(cluster)


def test_grpc_behind_the_same_key_and_tls(cluster, certs):
    tls = ClientTLS.from_files(ca=certs["ca"])
    with PdserveClient(cluster.target, timeout=30, tls=tls) as anonymous:
        assert anonymous.health() == "SERVING"
        with pytest.raises(PdserveError) as err:
            anonymous.generate([1, 2, 3], max_tokens=2)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with PdserveClient(cluster.target, timeout=30, tls=tls, api_key=KEY) as client:
        assert len(client.generate([1, 2, 3], max_tokens=2, temperature=0).token_ids) == 2


def _listening(pids: set[int]) -> list[tuple[int, str, str, int]]:
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            sockets = process.net_connections("inet")
            name = process.name()
        except psutil.Error:
            continue
        found += [(pid, name, c.laddr.ip, c.laddr.port) for c in sockets
                  if c.status == psutil.CONN_LISTEN]
    return found


def test_every_listening_socket_is_on_loopback(cluster, model_name, client):
    client.completions.create(model=model_name, prompt=list(range(5, 30)), max_tokens=2)
    me = psutil.Process()
    pids = cluster.started_pids() | {me.pid} | {p.pid for p in me.children(recursive=True)}
    sockets = _listening(pids)
    ports = {port for *_, port in sockets}
    assert {cluster.port, cluster.http_port, cluster.metrics_port} <= ports
    wide = [s for s in sockets if s[2] not in LOOPBACK]
    assert not wide, f"sockets listening beyond loopback: {wide}"


def test_hostile_joins_leave_the_decode_worker_serving(cluster, client, model_name, e2e):
    from torch.distributed import TCPStore

    from pdserve.kv_transfer.rendezvous import JOIN_KEY

    address = next(s.transfer_address for s in cluster.worker_stats().values()
                   if s.role == "decode")
    host, port = address.rsplit(":", 1)
    raw = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                   timeout=datetime.timedelta(seconds=10))
    for junk in ("garbage", "1", "x y z w", "999999 intruder", "7 intruder wrong-token"):
        raw.queue_push(JOIN_KEY, junk)
    for _ in range(3):
        out = client.completions.create(model=model_name, prompt=list(range(40, 70)),
                                        max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
    assert e2e.wait_idle(cluster)


def test_prefix_cache_hits_with_the_clusters_salted_hashes(cluster, client, model_name, e2e):
    def hits() -> int:
        return sum(s.prefix_hit_tokens for s in cluster.worker_stats().values()
                   if s.role == "prefill")

    before = hits()
    shared = list(range(100, 164))  # 16 blocks of 4
    for tail in ([1, 2], [3, 4]):
        client.completions.create(model=model_name, prompt=shared + tail, max_tokens=2)
    assert hits() - before >= 60
    assert e2e.wait_idle(cluster)
