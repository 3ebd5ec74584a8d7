"""Prefix-aware routing on the KV index: a router that never routed a prompt sends its prefix
to the prefill worker whose cache holds it, and its blocks to the decode worker whose cache
holds them (which then receives only the rest), knowing only what the workers published.
The prefill routing tests pin ``disaggregation="always"``: with "auto", a decode worker that
holds the prefix may compute the rest itself."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.config import RouterConfig
from pdserve.router.core import Router
from pdserve.router.directory import StaticDirectory
from pdserve.worker_api.sampling_params import SamplingParams
from pdserve.workers.build import build_local_workers

SALT = "cluster-salt"
ALWAYS = RouterConfig(disaggregation="always")
PROMPT = [(7 * i) % 300 + 3 for i in range(26)]  # six full blocks of 4, then two tokens


async def run(router: Router, request_id: str, prompt: list[int]):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    async for _ in router.generate(PreparedRequest(request_id, prompt, params, 3)):
        pass
    return router.traces[-1]


def test_a_router_that_started_late_sends_a_cached_prefix_to_its_holder(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=96,
                          prefix_cache_salt=SALT)
    handles = build_local_workers(config, num_prefill=2, num_decode=1)
    by_id = {h.worker_id: h for h in handles}
    prefill = sorted(h.worker_id for h in handles if h.role == "prefill")
    holder, other = prefill[1], prefill[0]  # (the queues alone would choose prefill[0])
    spec = ModelSpec("t", 256, 509, ())

    async def main():
        # the first router sees only the holder: the prompt is cached there
        first = Router(spec, StaticDirectory([h for h in handles if h.worker_id != other]),
                       tokenize=list, config=ALWAYS, prefix_cache_salt=SALT)
        await first.start()
        assert (await run(first, "warm", PROMPT)).prefill_routing.worker_id == holder
        await first.stop()
        late = Router(spec, StaticDirectory(handles), tokenize=list, config=ALWAYS,
                      prefix_cache_salt=SALT)
        await late.start()
        try:
            index = late.workers.kv_index
            held = by_id[holder].worker.engine.parts.block_manager.held_hashes()
            assert index.held(holder) == held and len(held) >= 6
            assert index.held(other) == frozenset()
            trace = await run(late, "again", PROMPT[:24] + [9, 9, 9])
            routing = trace.prefill_routing
            assert routing.worker_id == holder and routing.hit_blocks == 6
            assert routing.runner_up == other and routing.runner_up_cost == 0
        finally:
            await late.stop()
        # (one router at a time: routers in one process share the workers' outboxes)
        blind = Router(spec, StaticDirectory(handles), tokenize=list,
                       config=ALWAYS)  # without the salt
        await blind.start()
        try:
            assert (await run(blind, "blind", PROMPT[:24] + [8])).prefill_routing.worker_id \
                == other
        finally:
            await blind.stop()
            for h in handles:
                h.close()

    asyncio.run(main())


def test_a_colocated_pool_is_routed_on_the_index_too(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=96,
                          prefix_cache_salt=SALT)
    handles = build_local_workers(config, num_decode=2, colocated=True)
    ids = sorted(h.worker_id for h in handles)

    async def main():
        router = Router(ModelSpec("t", 256, 509, ()), StaticDirectory(handles), tokenize=list,
                        prefix_cache_salt=SALT)
        await router.start()
        try:
            first = (await run(router, "warm", PROMPT)).prefill_routing
            await router.workers.refresh()  # (the index takes the new blocks in)
            other = (await run(router, "other", [5] * 26)).prefill_routing
            await router.workers.refresh()  # (its stats no longer count "other" as queued)
            again = (await run(router, "again", PROMPT[:24] + [9, 9, 9])).prefill_routing
            return first, other, again
        finally:
            await router.stop()
            for h in handles:
                h.close()

    first, other, again = asyncio.run(main())
    assert first.worker_id in ids and first.hit_blocks == 0
    # the prompt's prefix goes back to the worker that computed it, whatever else it runs
    assert again.worker_id == first.worker_id and again.hit_blocks == 6
    assert {again.worker_id, again.runner_up} == set(ids)
    assert again.cost < again.runner_up_cost and other.hit_blocks == 0


def test_round_robin_prefill_routing_takes_the_workers_in_turn(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=96,
                          prefix_cache_salt=SALT)
    handles = build_local_workers(config, num_prefill=2, num_decode=1)

    async def main():
        router = Router(ModelSpec("t", 256, 509, ()), StaticDirectory(handles), tokenize=list,
                        config=RouterConfig(prefill_routing="round-robin",
                                            disaggregation="always"),
                        prefix_cache_salt=SALT)
        await router.start()
        try:
            routings = []
            for i in range(4):
                routings.append((await run(router, f"r{i}", PROMPT)).prefill_routing)
                await router.workers.refresh()  # (the index takes the new blocks in)
            return routings
        finally:
            await router.stop()
            for h in handles:
                h.close()

    routings = asyncio.run(main())
    assert [r.worker_id for r in routings] == ["prefill-0", "prefill-1"] * 2
    assert routings[2].hit_blocks == 6  # the index still says what the chosen one held
    with pytest.raises(ValueError, match="prefill_routing must be one of prefix, round-robin"):
        RouterConfig(prefill_routing="random")


def test_a_decode_worker_that_holds_the_prefix_gets_it_and_receives_only_the_rest(tiny_dir):
    """1P+2D: the decode worker that ran a prompt holds its blocks; a later request sharing
    six of them is reserved there (the index's hits count as room), is sent the blocks after
    them only. Each router starts after the one before it stopped: the index alone tells it."""
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=96,
                          prefix_cache_salt=SALT)
    handles = build_local_workers(config, num_prefill=1, num_decode=2)
    spec = ModelSpec("t", 256, 509, ())

    async def main():
        traces = []
        for request_id in ("warm", "again", "late"):
            router = Router(spec, StaticDirectory(handles), tokenize=list, config=ALWAYS,
                            prefix_cache_salt=SALT)
            await router.start()
            try:
                prompt = PROMPT if request_id == "warm" else PROMPT[:24] + [9, 9, len(traces)]
                traces.append(await run(router, request_id, prompt))
            finally:
                await router.stop()
        for h in handles:
            h.close()
        return traces

    warm, again, late = asyncio.run(main())
    holder = warm.decode_routing.worker_id
    assert (warm.decode_routing.hit_blocks, warm.decode_cached_blocks) == (0, 0)
    for trace in (again, late):
        routing = trace.decode_routing
        assert (routing.worker_id, routing.hit_blocks, trace.decode_cached_blocks) == \
            (holder, 6, 6)
        assert routing.runner_up != holder and routing.room == routing.runner_up_room + 6
