"""Priority and overload through the real router and real workers in this process: bounce
preemption keeps tokens identical and never prefills on the decode pool; a saturated pool
serves by priority; the per-request KV cap refuses at admission."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.core import Router, RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.router.errors import QueueFullError, RequestTooLargeError
from pdserve.testing.draw_check import draw_problems
from pdserve.testing.waits import async_wait_for
from pdserve.workers.build import build_local_workers

ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True,
                        frequency_penalty=0.2)


async def serve(model_dir, decode_blocks: int, policy: str = "priority", **router):
    config = EngineConfig(model=str(model_dir), **ENGINE, num_kv_blocks=decode_blocks,
                          scheduling_policy=policy)
    handles = build_local_workers(config, num_prefill=1, num_decode=1)
    router = Router(ModelSpec("t", 256, 509), StaticDirectory(handles), tokenize=list,
                    config=RouterConfig(stats_interval_s=0.05, scheduling_policy=policy,
                                        **router))
    await router.start()
    return handles, router


async def collect(router: Router, request_id: str, prompt, params, done: list[str]):
    tokens = []
    async for delta in router.generate(PreparedRequest(request_id, prompt, params,
                                                       params.max_tokens)):
        tokens += delta.token_ids
    done.append(request_id)
    return tokens


async def idle(handles) -> list[int]:
    async def used():
        counts = [(await h.stats()).used_blocks for h in handles]
        return counts if not any(counts) else False
    return await async_wait_for(used, 10, "every block back")


def chunk_sizes(decode_worker) -> list[int]:
    """Record the tokens each sequence computes in each step of the decode worker (a
    decode's: 1)."""
    sizes: list[int] = []
    schedule = decode_worker.engine.scheduler.schedule

    def recording():
        out = schedule()
        sizes.extend([1] * len(out.decodes) + [item.num_new_tokens for item in out.chunks])
        return out

    decode_worker.engine.scheduler.schedule = recording
    return sizes


@pytest.mark.parametrize("disaggregation", ["always", "never"])
def test_bounce_preemption_keeps_tokens(hf_checkpoint, disaggregation):
    """6 requests of 10 + 40 tokens need 78 blocks; the decode pool has 30: running
    sequences outgrow it and the lowest-priority ones are handed back and prefilled again,
    on the prefill pool (always: the decode worker only ever decodes) or on the decode worker
    itself (never), prompt + the tokens so far."""
    model_dir = hf_checkpoint("llama")
    reqs = [([(9 * i + j) % 300 + 3 for j in range(10)],
             dataclasses.replace(SEEDED if i % 2 else GREEDY, priority=i % 3))
            for i in range(6)]

    async def main():
        handles, router = await serve(model_dir, decode_blocks=30,
                                      disaggregation=disaggregation)
        decode = next(h.worker for h in handles if h.role == "decode")
        sizes = chunk_sizes(decode)
        try:
            results = await asyncio.wait_for(asyncio.gather(
                *(collect(router, f"r{i}", p, params, [])
                  for i, (p, params) in enumerate(reqs))), 120)
            bounces = decode.engine.scheduler.num_bounces
            return results, sizes, bounces, await idle(handles), list(router.traces)
        finally:
            await router.stop()
            for h in handles:
                h.close()

    results, sizes, bounces, used, traces = asyncio.run(main())
    # the offline tokens, up to a flip at a rounding boundary (re-prefill changes last bits)
    assert draw_problems(str(model_dir), reqs, results) == []
    assert bounces >= 1 and used == [0, 0]
    assert not any(t.num_migrations for t in traces)  # a bounce is not a failure
    if disaggregation == "always":
        assert set(sizes) == {1}  # only ever decoded
    else:
        assert max(sizes) > 1 and {t.prefill_location.location for t in traces} == {"local"}


def test_bounces_are_bounded_per_request(hf_checkpoint):
    """With max_bounces 0, the first request handed back fails with RESOURCE_EXHAUSTED (retry
    later) instead of bouncing again; the others finish and every block comes back."""
    model_dir = hf_checkpoint("llama")
    reqs = [([(9 * i + j) % 300 + 3 for j in range(10)],
             dataclasses.replace(GREEDY, priority=i % 3)) for i in range(6)]

    async def main():
        handles, router = await serve(model_dir, decode_blocks=30, max_bounces=0)
        try:
            async def one(i, prompt, params):
                try:
                    return await collect(router, f"r{i}", prompt, params, [])
                except QueueFullError as exc:
                    return exc
            results = await asyncio.wait_for(asyncio.gather(
                *(one(i, p, params) for i, (p, params) in enumerate(reqs))), 120)
            return results, await idle(handles)
        finally:
            await router.stop()
            for h in handles:
                h.close()

    results, used = asyncio.run(main())
    refused = [r for r in results if isinstance(r, QueueFullError)]
    assert refused and all("max_bounces 0" in str(r) for r in refused)
    assert all(len(r) == 40 for r in results if not isinstance(r, QueueFullError))
    assert used == [0, 0]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_saturated_pool_serves_by_policy(hf_checkpoint, policy):
    """The decode pool (10 blocks) holds one request (30 + 4 tokens: 9 blocks) at a time:
    after the first, the queue's order is the order requests finish in."""
    model_dir = hf_checkpoint("llama")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def main():
        handles, router = await serve(model_dir, decode_blocks=10, policy=policy)
        try:
            done: list[str] = []
            decode = next(h.worker for h in handles if h.role == "decode")
            decode.loop.inject_fault("stall", 1.0)  # first holds the pool while others queue
            first = asyncio.create_task(collect(router, "first", [3] * 30, params, done))
            await async_wait_for(lambda: decode.loop.busy_since, 10, "first decoding")
            tasks = [asyncio.create_task(collect(
                router, f"p{priority}", [4 + priority] * 30,
                dataclasses.replace(params, priority=priority), done))
                for priority in (5, 1, 3)]  # arrive in this order
            await asyncio.gather(first, *tasks)
            return done, await idle(handles)
        finally:
            await router.stop()
            for h in handles:
                h.close()

    done, used = asyncio.run(main())
    expected = ["p1", "p3", "p5"] if policy == "priority" else ["p5", "p1", "p3"]
    assert done == ["first", *expected] and used == [0, 0]


def test_the_kv_cap_refuses_at_admission(hf_checkpoint):
    model_dir = hf_checkpoint("llama")

    async def main():
        handles, router = await serve(model_dir, decode_blocks=40, max_request_kv_fraction=0.5)
        try:
            small = SamplingParams(max_tokens=8, temperature=0.0)
            async for _ in router.generate(PreparedRequest("ok", [3] * 40, small, 8)):
                pass  # 12 blocks <= 20
            with pytest.raises(RequestTooLargeError, match="max_request_kv_fraction"):
                big = SamplingParams(max_tokens=40)
                await router.generate(PreparedRequest("big", [3] * 60, big, 40)
                                      ).__anext__()  # 25 blocks > 20
            # no max_tokens from the client (a chat request is sized to the whole context):
            # lowered to what the cap holds, 20 blocks = 80 tokens, 60 of them the prompt
            unset = SamplingParams(max_tokens=196, temperature=0.0, ignore_eos=True)
            tokens = [t async for d in router.generate(PreparedRequest("fit", [3] * 60, unset,
                                                                       None))
                      for t in d.token_ids]
            assert len(tokens) == 20
            with pytest.raises(RequestTooLargeError, match="max_request_kv_fraction"):
                await router.generate(PreparedRequest("never", [3] * 81, unset, None)
                                      ).__anext__()  # the prompt alone
            return await idle(handles)
        finally:
            await router.stop()
            for h in handles:
                h.close()

    assert asyncio.run(main()) == [0, 0]
