"""Streaming overhead per token: ``python -m pdserve.bench.http [--tokens N] [--rounds R]``.

Prints; never asserts. In one run, on this machine, the same zero-compute backend
(``pdserve.testing.fake_backend.FakeBackend``: no model, one token per delta) streams N tokens
through each front door, and the time per token is compared with iterating the backend in
process:

* in-process: ``backend.generate`` iterated directly (the baseline: what the router costs);
* gRPC: ``GenerationServer`` + ``AsyncPdserveClient`` over loopback;
* HTTP (raw SSE): ``HttpServer`` (FastAPI + uvicorn) + httpx, each ``data:`` line parsed as
  JSON, as a minimal OpenAI client does;
* HTTP (openai package): the same server through ``openai.AsyncOpenAI`` streaming.

Server and client share one event loop and this machine's cores, so each figure is the whole
per-token cost of one stream (server and client work together); the median of ``--rounds``
runs is shown. ``--api-key`` puts the key check on both servers (a per-request cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from pdserve.api.client import AsyncPdserveClient
from pdserve.bench.stats import format_table
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.grpc_server import GenerationServer
from pdserve.router.http_server import HttpServer
from pdserve.testing.fake_backend import FakeBackend
from pdserve.worker_api.sampling_params import SamplingParams

MODEL = ModelSpec("fake", max_context_tokens=1 << 20, vocab_size=64, eos_token_ids=())


async def _in_process(backend: FakeBackend, num_tokens: int) -> float:
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    start, count = time.perf_counter(), 0
    async for delta in backend.generate(PreparedRequest("bench", [1, 2], params, num_tokens)):
        count += len(delta.token_ids)
    return (time.perf_counter() - start) / count


async def _grpc(port: int, num_tokens: int, api_key: str | None) -> float:
    async with AsyncPdserveClient(f"127.0.0.1:{port}", api_key=api_key) as client:
        await client.generate([1, 2], max_tokens=4, ignore_eos=True)  # connect, warm up
        start, count = time.perf_counter(), 0
        async for chunk in client.generate_stream([1, 2], max_tokens=num_tokens,
                                                  ignore_eos=True):
            count += len(chunk.token_ids)
        return (time.perf_counter() - start) / count


async def _http_raw(port: int, num_tokens: int, api_key: str | None) -> float:
    # lazy: a test dependency, needed only by the HTTP rows
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": MODEL.model_name, "prompt": [1, 2], "max_tokens": num_tokens,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers,
                                 timeout=120) as client:
        await client.post("/v1/completions", json={**body, "max_tokens": 4, "stream": False})
        start, count = time.perf_counter(), 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    count += len(chunk["choices"][0]["text"])  # one character per token
        return (time.perf_counter() - start) / count


async def _http_openai(port: int, num_tokens: int, api_key: str | None) -> float:
    # lazy: a test dependency, needed only by the HTTP rows
    import openai

    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                  api_key=api_key or "none", max_retries=0) as client:
        await client.completions.create(model=MODEL.model_name, prompt=[1, 2], max_tokens=4)
        start, count = time.perf_counter(), 0
        stream = await client.completions.create(model=MODEL.model_name, prompt=[1, 2],
                                                 max_tokens=num_tokens, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            count += len(chunk.choices[0].text)
        return (time.perf_counter() - start) / count


async def measure(num_tokens: int, rounds: int, api_key: str | None = None) -> dict:
    """Median seconds per token of each path (see the module docstring)."""
    backend = FakeBackend(MODEL)
    grpc_server = GenerationServer(backend, api_key=api_key)
    http_server = HttpServer(backend, api_key=api_key)
    grpc_port = await grpc_server.start("127.0.0.1", 0)
    http_port = await http_server.start("127.0.0.1", 0)
    paths = {"in-process router backend": lambda: _in_process(backend, num_tokens),
             "gRPC": lambda: _grpc(grpc_port, num_tokens, api_key),
             "HTTP SSE (httpx)": lambda: _http_raw(http_port, num_tokens, api_key),
             "HTTP SSE (openai package)": lambda: _http_openai(http_port, num_tokens, api_key)}
    results: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for _ in range(rounds):
            for name, run in paths.items():
                results[name].append(await run())
    finally:
        await http_server.stop(1.0)
        await grpc_server.stop(0)
    return {name: statistics.median(values) for name, values in results.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="runs per path (median shown)")
    parser.add_argument("--api-key", default=None, help="check this key on both servers")
    args = parser.parse_args(argv)
    per_token = asyncio.run(measure(args.tokens, args.rounds, args.api_key))
    base = per_token["in-process router backend"]
    grpc_cost = per_token["gRPC"]
    rows = [[name, value * 1e6, value / base, (value - base) * 1e6,
             value / grpc_cost] for name, value in per_token.items()]
    print(f"Streaming overhead per token, zero-compute backend, {args.tokens} tokens per "
          f"stream, median of {args.rounds} (server and client on one loop)")
    print(format_table(["path", "us/token", "x in-process", "front door us/token",
                        "x gRPC"], rows))


if __name__ == "__main__":
    main()
