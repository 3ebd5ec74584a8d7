"""Conditional disaggregation: the router prefills a prompt on the decode worker itself when
its cost model says that is cheaper and the prompt is short; the tokens stay the same."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.api.admin_client import trace_dict
from pdserve.bench.phases import prefill_locations
from pdserve.engine.config import EngineConfig
from pdserve.router.admin_server import trace_pb
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.config import RouterConfig
from pdserve.router.core import Router
from pdserve.router.directory import StaticDirectory
from pdserve.router.pairing import PrefillRouting, TransferCost, WorkerLoad, prefill_location
from pdserve.router.trace import RequestTrace
from pdserve.worker_api import WorkerStats
from pdserve.worker_api.sampling_params import SamplingParams
from pdserve.workers.build import build_local_workers

LOCATION = "pdserve_prefill_location_total"


def decode_load(queued: int = 0, pending: int = 0, running: int = 0) -> WorkerLoad:
    load = WorkerLoad(WorkerStats("d", "decode", 128, 100, 28, 0, running, 0, queued, 0, 0, 0))
    if pending:
        load.sent(tokens=pending, at=1.0)
    return load


def best_prefill(cost: float) -> PrefillRouting:
    return PrefillRouting("p", hit_blocks=0, cost=cost)


@pytest.mark.parametrize("decode, prefill, tokens_per_block, where", [
    (decode_load(), best_prefill(0), 2.0, "local"),  # only the transfer differs: local
    (decode_load(), best_prefill(0), 0.0, "remote"),  # transfer not measured yet: a tie
    (decode_load(queued=30), best_prefill(0), 2.0, "remote"),  # 130 > 100 + 10 * 2
    (decode_load(pending=30), best_prefill(0), 2.0, "remote"),  # sent, not in stats yet
    (decode_load(queued=30), best_prefill(50), 0.0, "local"),  # the prefill queue is deeper
    (decode_load(), best_prefill(-64), 2.0, "remote"),  # the prefill worker holds the prefix
    (decode_load(), None, 0.0, "local"),  # no prefill worker at all
])
def test_auto_takes_the_cheaper_place(decode, prefill, tokens_per_block, where):
    got = prefill_location(1024, 100, decode, prefill, 10, tokens_per_block)
    assert got.location == where
    assert got.local_cost == decode.stats.queued_tokens + decode.pending_tokens + 100
    expected_remote = (float("inf") if prefill is None
                       else prefill.cost + 100 + 10 * tokens_per_block)
    assert got.remote_cost == expected_remote


def test_requests_decoding_on_the_worker_count_the_stall_a_local_prefill_adds():
    busy = decode_load(running=3)  # each of the three waits 100 tokens more for its next one
    got = prefill_location(1024, 100, busy, best_prefill(0), 10, 2.0)
    assert (got.location, got.local_cost, got.remote_cost) == ("remote", 400, 120)
    assert prefill_location(1024, 100, busy, best_prefill(0), 10, 2.0, stall_weight=0.5) \
        .local_cost == 250
    assert prefill_location(1024, 100, busy, best_prefill(0), 10, 2.0, stall_weight=0) \
        .location == "local"  # the request's own first token alone: no transfer
    assert prefill_location(1024, 100, busy, best_prefill(300), 10, 2.0).location == "local"


def test_a_prompt_over_the_local_limit_goes_remote_however_cheap():
    assert prefill_location(99, 100, decode_load(), None, 10, 2.0).location == "remote"
    assert prefill_location(100, 100, decode_load(), None, 10, 2.0).location == "local"


def test_a_decode_worker_without_the_blocks_free_prefills_nothing_itself():
    load = decode_load()  # 100 blocks free
    assert prefill_location(1024, 100, load, None, 100, 2.0).location == "local"
    assert prefill_location(1024, 100, load, None, 101, 2.0).location == "remote"
    load.sent(blocks=1, at=1.0)  # reserved by this router since the stats
    assert prefill_location(1024, 100, load, None, 100, 2.0).location == "remote"


def test_the_decode_workers_cached_prefix_is_neither_computed_nor_sent():
    """The decode worker holds 5 of the prompt's blocks of 16: a local prefill computes the 20
    tokens after them (the limit applies to those), a remote one sends 5 blocks less."""
    busy = decode_load(running=3)
    got = prefill_location(50, 100, busy, best_prefill(0), 7, 2.0, decode_hit_blocks=5)
    assert (got.location, got.local_cost, got.remote_cost) == ("local", 80, 104)
    assert prefill_location(50, 100, busy, best_prefill(0), 7, 2.0).location == "remote"


def test_transfer_cost_is_a_weighted_average_of_what_was_seen():
    cost = TransferCost(weight=0.5)
    assert cost.tokens_per_block == 0.0
    cost.observe(tokens=100, prefill_s=1.0, blocks=10, transfer_s=0.5)  # 0.01 s/token
    assert cost.tokens_per_block == pytest.approx(5.0)  # 0.05 s/block
    cost.observe(tokens=100, prefill_s=1.0, blocks=10, transfer_s=1.5)  # 0.15 s/block
    assert cost.tokens_per_block == pytest.approx(10.0)  # (0.05 + 0.15) / 2 / 0.01
    cost.observe(tokens=0, prefill_s=0.0, blocks=0, transfer_s=0.0)  # nothing computed: kept
    assert cost.tokens_per_block == pytest.approx(10.0)


@pytest.mark.parametrize("field, value", [("disaggregation", "sometimes"),
                                          ("max_local_prefill_length", -1),
                                          ("local_prefill_stall_weight", -1.0),
                                          ("local_prefill_stall_weight", float("nan"))])
def test_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


def _cluster(tiny_dir, num_decode=1):
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=96)
    return build_local_workers(config, num_prefill=1, num_decode=num_decode)


async def _generate(router: Router, request_id: str, prompt: list[int], max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = []
    async for delta in router.generate(PreparedRequest(request_id, prompt, params, max_tokens)):
        tokens += delta.token_ids
    trace = next(t for t in reversed(router.traces) if t.request_id == request_id)
    return tokens, trace


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 500 + 3 for i in range(n)]


def _run(handles, config: RouterConfig, body):
    async def main():
        router = Router(ModelSpec("t", 256, 509, ()), StaticDirectory(handles), tokenize=list,
                        config=config)
        await router.start()
        try:
            return await body(router)
        finally:
            await router.stop()

    try:
        return asyncio.run(main())
    finally:
        for h in handles:
            h.close()


def test_local_prefill_gives_the_remote_tokens_and_leaves_the_prefill_worker_idle(tiny_dir):
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 23, 40))]

    async def always(router):
        return [await _generate(router, f"a{i}", p) for i, p in enumerate(prompts)]

    async def never(router):  # all at once: the local prefills share decode steps
        return await asyncio.gather(*(_generate(router, f"n{i}", p)
                                      for i, p in enumerate(prompts)))

    remote = _run(_cluster(tiny_dir), RouterConfig(disaggregation="always"), always)
    handles = _cluster(tiny_dir)
    prefill = next(h for h in handles if h.role == "prefill")
    local = _run(handles, RouterConfig(disaggregation="never"), never)
    assert [tokens for tokens, _ in local] == [tokens for tokens, _ in remote]
    assert all(len(tokens) == 8 for tokens, _ in local)
    assert [t.prefill_location.location for _, t in remote] == ["remote"] * 3
    assert [t.prefill_location.location for _, t in local] == ["local"] * 3
    assert all(t.transfer == 0 and t.prefill > 0 and t.prefill_routing is None
               for _, t in local)
    assert prefill.worker.engine.parts.block_manager.num_prefix_query_tokens == 0


def test_auto_prefills_short_prompts_locally_once_the_transfer_is_measured(tiny_dir):
    config = RouterConfig(disaggregation="auto", max_local_prefill_length=32)
    handles = _cluster(tiny_dir)
    prefill = next(h for h in handles if h.role == "prefill")

    async def body(router):
        first = await _generate(router, "first", _prompt(12, 1))  # no transfer seen: a tie
        tokens_per_block = router._transfer_cost.tokens_per_block
        await router.workers.refresh()  # stats that count the first prompt as done
        short = await _generate(router, "short", _prompt(12, 2))
        await router.workers.refresh()
        long = await _generate(router, "long", _prompt(40, 3))  # over the limit
        registry = router.metrics.registry
        counts = {where: registry.get_sample_value(LOCATION, {"location": where})
                  for where in ("local", "remote")}
        return first[1], short[1], long[1], counts, tokens_per_block, list(router.traces)

    first, short, long, counts, tokens_per_block, traces = _run(handles, config, body)
    assert first.prefill_location.location == "remote" and first.transfer > 0
    assert tokens_per_block > 0
    assert short.prefill_location.location == "local"
    assert short.prefill_location.local_cost == 12
    assert short.prefill_location.remote_cost == pytest.approx(12 + 3 * tokens_per_block)
    assert long.prefill_location.location == "remote"
    assert long.prefill_location.local_cost == 40  # cheaper, but over the limit
    assert counts == {"local": 1, "remote": 2}
    # the prefill worker computed the first and the long prompt only
    assert prefill.worker.engine.parts.block_manager.num_prefix_query_tokens == 12 + 40
    # what bench serve and the demo print, from the router's traces or Admin's
    assert prefill_locations(traces) == {"remote": 2, "local": 1}
    over_admin = [trace_dict(trace_pb(t)) for t in traces]
    assert [t["prefill_location"] for t in over_admin] == ["remote", "local", "remote"]
    assert prefill_locations(over_admin) == {"remote": 2, "local": 1}
    assert prefill_locations([trace_dict(trace_pb(RequestTrace("c", 0.1, 0.2)))]) is None


def test_prompt_logprobs_and_logit_bias_hold_wherever_the_prompt_is_prefilled(tiny_dir):
    """The decode worker prefilling itself (never) scores the prompt and applies the bias as
    the prefill worker does (always): the same prompt logprobs with token 0, the same
    forced tokens on both sides of the hand-off."""
    prompt = _prompt(23, 4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2,
                            logit_bias={77: 100.0})

    async def run(router):
        deltas = [d async for d in router.generate(PreparedRequest("b", prompt, params, 4))]
        return [t for d in deltas for t in d.token_ids], [d.prompt_logprobs for d in deltas]

    results = {mode: _run(_cluster(tiny_dir), RouterConfig(disaggregation=mode), run)
               for mode in ("always", "never")}
    for tokens, scores in results.values():
        assert tokens == [77] * 4
        assert scores[0] is not None and len(scores[0]) == len(prompt) and scores[0][0] is None
        assert all(s is None for s in scores[1:])
    remote, local = (results[mode][1][0] for mode in ("always", "never"))
    for there, here in zip(remote[1:], local[1:], strict=True):
        assert there.keys() == here.keys()
        assert all(abs(there[t] - here[t]) < 1e-4 for t in there)
