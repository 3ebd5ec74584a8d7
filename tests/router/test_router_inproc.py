"""The router core behind the real gRPC server, with workers in this process."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.api.client import AsyncPdserveClient, PdserveError
from pdserve.engine.config import EngineConfig
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.core import Router
from pdserve.router.directory import StaticDirectory
from pdserve.router.grpc_server import GenerationServer
from pdserve.testing.waits import async_wait_for
from pdserve.workers.build import build_local_workers


def config_for(model_dir, **kw) -> EngineConfig:
    base = dict(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=96,
                max_num_batched_tokens=32)
    return EngineConfig(**{**base, **kw})


async def serve(model_dir, **build_kwargs):
    handles = build_local_workers(config_for(model_dir), **build_kwargs)
    spec = ModelSpec("test", 256, 509, ())
    router = Router(spec, StaticDirectory(handles), tokenize=lambda text: [1, 2, 3])
    await router.start()
    server = GenerationServer(router, health_poll_interval_s=0.05)
    port = await server.start("127.0.0.1", 0)
    return handles, router, server, port


async def shutdown(handles, router, server):
    await server.stop(0)
    await router.stop()
    for h in handles:
        h.close()


def used_blocks(handles) -> list[int]:
    return [h.worker.stats().result(10).used_blocks for h in handles]


def prompts_for(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 200) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("build", [dict(num_prefill=1, num_decode=1),
                                   dict(num_prefill=2, num_decode=2),
                                   dict(colocated=True, num_decode=1)],
                         ids=["1P1D", "2P2D", "colocated"])
def test_concurrent_greedy_equals_offline(hf_checkpoint, build):
    model_dir = hf_checkpoint("qwen2")
    prompts = prompts_for(0, 8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(model_dir), dtype="float32", block_size=4,
                                         num_kv_blocks=96).generate(prompts, params,
                                                                    use_tqdm=False)]

    async def main():
        handles, router, server, port = await serve(model_dir, **build)
        try:
            async with AsyncPdserveClient(f"127.0.0.1:{port}") as client:
                results = await asyncio.gather(*(
                    client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True)
                    for p in prompts))
            assert [r.token_ids for r in results] == expected
            assert all(r.finish_reason == "length" for r in results)
            await async_wait_for(lambda: used_blocks(handles) == [0] * len(handles),
                                 10, "every block back")
            assert len(router.traces) == len(prompts)
        finally:
            await shutdown(handles, router, server)

    asyncio.run(main())


@pytest.mark.parametrize("build", [dict(num_prefill=1, num_decode=1),
                                   dict(colocated=True, num_decode=1)],
                         ids=["1P1D", "colocated"])
def test_cancel_and_deadline_free_all_blocks(hf_checkpoint, build):
    model_dir = hf_checkpoint("llama")

    async def main():
        handles, router, server, port = await serve(model_dir, **build)
        try:
            async with AsyncPdserveClient(f"127.0.0.1:{port}") as client:
                stream = client.generate_stream([5, 6, 7, 8] * 5, max_tokens=200,
                                                temperature=0.0, ignore_eos=True)
                async for _chunk in stream:
                    break  # cancel mid-stream
                await stream.aclose()
                with pytest.raises(PdserveError) as err:
                    await client.generate([9, 10, 11], max_tokens=200, temperature=0.0,
                                          ignore_eos=True, timeout=0.05)
                assert "DEADLINE_EXCEEDED" in str(err.value.code)
            await async_wait_for(lambda: used_blocks(handles) == [0] * len(handles),
                                 10, "every block back")
        finally:
            await shutdown(handles, router, server)

    asyncio.run(main())


def test_admission_bounds_requests_in_flight(hf_checkpoint):
    from pdserve.router.core import RouterConfig
    from pdserve.router.errors import QueueFullError

    model_dir = hf_checkpoint("llama")

    async def main():
        handles = build_local_workers(config_for(model_dir))
        router = Router(ModelSpec("t", 256, 509), StaticDirectory(handles), tokenize=list,
                        config=RouterConfig(max_requests_in_flight=1, max_tokens_in_flight=64))
        await router.start()
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        try:
            first = router.generate(PreparedRequest("a", [1, 2, 3], params, 50))
            await first.__anext__()
            with pytest.raises(QueueFullError):
                await router.generate(PreparedRequest("b", [4, 5], params, 50)).__anext__()
            await first.aclose()
            with pytest.raises(QueueFullError):  # too many prompt tokens at once
                await router.generate(PreparedRequest("c", list(range(1, 70)), params,
                                                      50)).__anext__()
            await async_wait_for(lambda: used_blocks(handles) == [0, 0], 10,
                                 "every block back")
        finally:
            await router.stop()
            for h in handles:
                h.close()

    asyncio.run(main())


@pytest.mark.parametrize("build", [dict(num_prefill=1, num_decode=1),
                                   dict(colocated=True, num_decode=1)],
                         ids=["1P1D", "colocated"])
def test_seeded_sampling_text_stop_and_logprobs_match_offline(hf_checkpoint, build):
    """Random draws are keyed by (seed, position): the same tokens whichever worker samples."""
    model_dir = hf_checkpoint("llama")
    offline = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=96)
    prompt = "The quick brown fox jumps over the lazy dog"
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=42,
                            ignore_eos=True, logprobs=2)
    want = offline.generate([prompt], params, use_tqdm=False)[0]
    stop = want.text[3:6] if len(want.text) > 6 else None
    want_stopped = offline.generate([prompt], SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=42, ignore_eos=True,
        stop=[stop] if stop else []), use_tqdm=False)[0]

    async def main():
        handles = build_local_workers(config_for(model_dir), **build)
        tokenizer = offline.tokenizer
        router = Router(ModelSpec("t", 256, 509), StaticDirectory(handles),
                        tokenize=tokenizer.encode)
        await router.start()
        server = GenerationServer(router, health_poll_interval_s=0.05)
        port = await server.start("127.0.0.1", 0)
        try:
            async with AsyncPdserveClient(f"127.0.0.1:{port}") as client:
                got = await client.generate(prompt, max_tokens=12, temperature=0.9, top_p=0.95,
                                            top_k=50, seed=42, ignore_eos=True, logprobs=2)
                got_stopped = await client.generate(
                    prompt, max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=42,
                    ignore_eos=True, stop=[stop] if stop else None)
            return got, got_stopped
        finally:
            await shutdown(handles, router, server)

    got, got_stopped = asyncio.run(main())
    assert got.token_ids == want.token_ids and got.text == want.text
    assert len(got.logprobs) == len(want.token_ids)
    assert got_stopped.text == want_stopped.text
    assert got_stopped.finish_reason == want_stopped.finish_reason


@pytest.mark.parametrize("build", [dict(num_prefill=1, num_decode=1),
                                   dict(colocated=True, num_decode=1)],
                         ids=["1P1D", "colocated"])
def test_compact_deltas_reach_the_client_as_offline_text(hf_checkpoint, build):
    """Workers ship a pure decode step's deltas as columns (StepDeltas' encoding, texts
    filled); the router reads them: every request's tokens and text equal the offline LLM's."""
    model_dir = hf_checkpoint("llama")
    offline = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=96)
    prompts = ["The quick brown fox", "Hello there, how are", "One two three four five"]
    seeds = [None, 7, 8]
    want = [offline.generate([p], SamplingParams(
        max_tokens=14, ignore_eos=True, temperature=0.0 if s is None else 0.8, seed=s),
        use_tqdm=False)[0] for p, s in zip(prompts, seeds, strict=True)]

    async def main():
        handles = build_local_workers(config_for(model_dir), **build)
        compact = []
        for handle in handles:
            poll = handle.poll

            async def spy(timeout, poll=poll):
                deltas = await poll(timeout)
                deltas.read(lambda *token: compact.append(1), lambda delta: None)
                return deltas
            handle.poll = spy
        router = Router(ModelSpec("t", 256, 509), StaticDirectory(handles),
                        tokenize=offline.tokenizer.encode)
        await router.start()
        server = GenerationServer(router, health_poll_interval_s=0.05)
        port = await server.start("127.0.0.1", 0)
        try:
            async with AsyncPdserveClient(f"127.0.0.1:{port}") as client:
                got = await asyncio.gather(*[client.generate(
                    p, max_tokens=14, ignore_eos=True, seed=s,
                    temperature=0.0 if s is None else 0.8)
                    for p, s in zip(prompts, seeds, strict=True)])
            return got, compact, used_blocks(handles)
        finally:
            await shutdown(handles, router, server)

    got, compact, used = asyncio.run(main())
    assert [(g.token_ids, g.text) for g in got] == [(w.token_ids, w.text) for w in want]
    assert sum(compact) > 10  # most tokens came as columns
    assert used == [0] * len(used)
