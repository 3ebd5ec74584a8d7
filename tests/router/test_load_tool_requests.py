"""The requests three third-party load tools send, replayed against the OpenAI HTTP front door
(real uvicorn over loopback, the FakeBackend), and the answers read the way each tool reads
them. The tools need not be installed: their requests are data, captured by a logging proxy
between each tool and ``pdserve serve`` on SmolLM2 (bench/load_tools/run.sh; the prompts
shortened): aiperf 0.13.0, guidellm 0.8.1 and inference-perf 0.7.0, completions and chat
(inference-perf's random data makes completions only). docs/benchmarking.md runs the tools
themselves."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import pytest

from pdserve.router.backend import ModelSpec
from pdserve.router.http_server import HttpServer
from pdserve.testing.fake_backend import FakeBackend, FakePromptTools
from pdserve.testing.loop_thread import LoopThread
from pdserve.testing.waits import wait_for
from pdserve.worker_api.sampling_params import SamplingParams

MODEL = "smollm2-hf"
SHAKESPEARE = (" man Go call him hither boy Exit Page Aside The deeprevolving witty Buckingham "
               "No more shall be the neighbour to my counsels")  # aiperf's corpus
FAKER = ("1 0 m0 Finish medical want almost away until. Its culture song reveal return "
         "finally affect.\nPush page seem quickly actually memory than.")  # guidellm's
RANDOM_WORDS = "hill diure oscillato thicker heart proph majority spac trium"  # inference-perf
AIOHTTP = {"accept": "*/*", "accept-encoding": "gzip, deflate",
           "user-agent": "Python/3.12 aiohttp/3.14.5", "content-type": "application/json"}
AIPERF = {"user-agent": "aiperf/0.13.0", "x-request-id": "c41f2974-c42d-4d95-81fe-67e424fea111",
          "x-correlation-id": "b7edb4c0-4944-4c2e-99ae-c79cea81ac61",
          "accept": "text/event-stream", "content-type": "application/json",
          "x-session-affinity": "b7edb4c0-4944-4c2e-99ae-c79cea81ac61"}
HTTPX = {"accept": "*/*", "accept-encoding": "gzip, deflate", "connection": "keep-alive",
         "user-agent": "python-httpx/0.29.0", "content-type": "application/json"}
GUIDELLM_STREAM = {"include_usage": True, "continuous_usage_stats": True}


@dataclass
class ToolRequest:
    """What one tool sent: its probes before the run (method, path, the statuses it goes on
    with), then one generation request (headers and body, keys in the tool's order)."""

    tool: str
    path: str
    headers: dict[str, str]
    body: dict
    probes: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)

    @property
    def chat(self) -> bool:
        return self.path == "/v1/chat/completions"

    @property
    def name(self) -> str:
        return f"{self.tool}-{'chat' if self.chat else 'completions'}"

    @property
    def max_tokens(self) -> int:
        return self.body.get("max_tokens") or self.body["max_completion_tokens"]


# aiperf probes the server's Prometheus endpoint (any answer will do; pdserve's is on its own
# port) and sends the prompt; guidellm checks /health (it stops on anything but 2xx)
METRICS_PROBES = [("HEAD", "/metrics", (200, 404, 405)), ("GET", "/metrics", (200, 404))]
REQUESTS = [
    ToolRequest("aiperf", "/v1/completions", AIPERF,
                {"prompt": SHAKESPEARE, "model": MODEL, "stream": True, "max_tokens": 64,
                 "ignore_eos": True, "stream_options": {"include_usage": True}},
                METRICS_PROBES),
    ToolRequest("aiperf", "/v1/chat/completions", AIPERF,
                {"messages": [{"role": "user", "content": SHAKESPEARE}], "model": MODEL,
                 "stream": True, "max_completion_tokens": 8, "ignore_eos": True,
                 "stream_options": {"include_usage": True}}, METRICS_PROBES),
    ToolRequest("guidellm", "/v1/completions", HTTPX,
                {"model": MODEL, "stream": True, "stream_options": GUIDELLM_STREAM,
                 "max_tokens": 64, "stop": None, "ignore_eos": True, "prompt": FAKER},
                [("GET", "/health", (200,))]),
    ToolRequest("guidellm", "/v1/chat/completions", HTTPX,
                {"model": MODEL, "stream": True, "stream_options": GUIDELLM_STREAM,
                 "max_completion_tokens": 8, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": FAKER}]}]},
                [("GET", "/health", (200,))]),
    ToolRequest("inference-perf", "/v1/completions", AIOHTTP,
                {"model": MODEL, "prompt": RANDOM_WORDS, "max_tokens": 64, "ignore_eos": True,
                 "stream": True, "stream_options": {"include_usage": True}}),
]


async def _start(backend: FakeBackend) -> HttpServer:
    server = HttpServer(backend, model_root="/tmp/peer-model/smollm2-hf",
                        tools=FakePromptTools(backend))
    await server.start("127.0.0.1", 0)
    return server


@pytest.fixture(scope="module")
def served():
    loop = LoopThread()
    backend = FakeBackend(ModelSpec(MODEL, max_context_tokens=4096, vocab_size=64,
                                    eos_token_ids=(63,)))
    server = loop.run(_start(backend))
    yield backend, f"http://127.0.0.1:{server.port}"
    loop.run(server.stop(1.0))
    loop.close()


def sse_data(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, as inference-perf and aiperf split it: events
    end at a blank line, a payload is the rest of its line after ``data:``."""
    out = []
    for event in raw.split(b"\n\n"):
        out += [line.removeprefix(b"data:").strip() for line in event.split(b"\n")
                if line.startswith(b"data:")]
    return out


@dataclass
class Read:
    """What a tool takes from a stream."""

    text: str  # the output text, its content deltas joined
    num_content_chunks: int  # chunks with text (each a timestamp: TTFT, then ITL)
    usage: dict | None  # the last usage that was not null
    usages: list  # every chunk's usage field, in order


def read_stream(raw: bytes, chat: bool) -> Read:
    """The common reading: JSON until ``[DONE]`` (nothing after it), an ``error`` object
    fails the request (guidellm's ``_check_streaming_error``), ``choices[0]`` may be absent
    (the usage chunk: inference-perf guards ``IndexError``)."""
    payloads = sse_data(raw)
    assert payloads and payloads[-1] == b"[DONE]", "the stream must end with data: [DONE]"
    text, num_content, usage, usages = "", 0, None, []
    for payload in payloads[:-1]:
        data = json.loads(payload)
        assert "error" not in data, data
        usages.append(data.get("usage"))
        if isinstance(data.get("usage"), dict):
            usage = data["usage"]
        if not data["choices"]:
            continue
        choice = data["choices"][0]
        content = choice["delta"].get("content") if chat else choice["text"]
        if content:
            text += content
            num_content += 1
    return Read(text, num_content, usage, usages)


@pytest.mark.parametrize("sent", REQUESTS, ids=lambda r: r.name)
def test_a_tool_s_request_is_answered_as_the_tool_reads_it(served, sent: ToolRequest):
    backend, url = served
    with httpx.Client(base_url=url, timeout=10) as client:
        for method, path, statuses in sent.probes:
            assert client.request(method, path).status_code in statuses, (method, path)
        response = client.post(sent.path, content=json.dumps(sent.body), headers=sent.headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    request = backend.started[-1]
    ids, reason = backend.expected_output(request.prompt_token_ids,
                                          SamplingParams(max_tokens=sent.max_tokens,
                                                         ignore_eos=True))
    assert (len(ids), reason) == (sent.max_tokens, "length")  # ignore_eos: the full length
    read = read_stream(response.content, sent.chat)
    assert read.text == backend.decode(ids)
    assert read.num_content_chunks == sent.max_tokens  # a chunk per token: ITL per token
    assert read.usage == {"prompt_tokens": len(request.prompt_token_ids),
                          "completion_tokens": sent.max_tokens,
                          "total_tokens": len(request.prompt_token_ids) + sent.max_tokens}
    if sent.body["stream_options"].get("continuous_usage_stats"):
        # every chunk: the usage so far (the role chunk 0 tokens, then one more per token)
        counts = [u["completion_tokens"] for u in read.usages]
        assert counts == [0] * sent.chat + list(range(1, sent.max_tokens + 1)) + [
            sent.max_tokens]
    else:  # null on every chunk but the last, which has no choices
        assert read.usages[:-1] == [None] * (len(read.usages) - 1)
    wait_for(lambda: backend.num_running == 0, 5, "no request left running")


def test_continuous_usage_needs_include_usage(served):
    """As vLLM: ``continuous_usage_stats`` alone adds nothing, and no usage chunk."""
    _, url = served
    body = {"model": MODEL, "prompt": FAKER, "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"continuous_usage_stats": True}}
    response = httpx.post(url + "/v1/completions", json=body, timeout=10)
    chunks = [json.loads(p) for p in sse_data(response.content)[:-1]]
    assert len(chunks) == 4 and all("usage" not in c for c in chunks)


def test_the_model_a_tool_infers_from_the_model_list_is_served(served):
    """Without a model name, inference-perf and guidellm take ``data[0].id`` of
    ``GET /v1/models`` (aiperf's readiness probe looks its name up there); that name, and the
    folder the server was started with, are served."""
    _, url = served
    listed = httpx.get(url + "/v1/models", timeout=10).json()
    inferred = listed["data"][0]["id"]
    assert inferred == MODEL
    for model in (inferred, "/tmp/peer-model/smollm2-hf"):
        body = {"model": model, "prompt": FAKER, "max_tokens": 2, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert answer.status_code == 200 and answer.json()["model"] == MODEL, answer.text
