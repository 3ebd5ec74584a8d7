"""The router with LoRA workers (real engines in this process, the router's own placement): a
request under an adapter reaches a worker with it and yields PEFT's greedy tokens; the next
one for that adapter goes to the worker holding it, and the trace, Admin's trace and the
metrics say where the adapter was and whether it was loaded for the request."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from pdserve.api.admin_client import trace_dict
from pdserve.bench.phases import adapter_loads
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.router.admin_server import trace_pb
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.config import RouterConfig
from pdserve.router.core import Router
from pdserve.router.directory import StaticDirectory
from pdserve.router.metrics import RouterMetrics
from pdserve.router.trace import RequestTrace
from pdserve.testing.lora_adapters import peft_greedy, write_peft_adapter
from pdserve.worker_api import WorkerStats
from pdserve.worker_api.sampling_params import SamplingParams
from pdserve.workers.build import build_local_workers

SALT = "cluster-salt"
PROMPT = [(7 * i) % 300 + 3 for i in range(10)]


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    """Four PEFT adapters of the tiny model (folders), written once for the module."""
    root = tmp_path_factory.mktemp("lora-router")
    return [write_peft_adapter(tiny_dir, root / name, rank=4, seed=seed)
            for seed, name in enumerate(("sql", "chat", "code", "math"))]


async def run(router: Router, label: str, prompt: list[int], adapter=None):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = []
    async for delta in router.generate(PreparedRequest(label, prompt, params, 4,
                                                       adapter=adapter)):
        tokens += delta.token_ids
    return tokens, router.traces[-1]


def test_requests_for_an_adapter_go_to_the_worker_that_holds_it(tiny_dir, adapters):
    sql, chat = (LLM.adapter(path) for path in adapters[:2])
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=64,
                          prefix_cache_salt=SALT, enable_lora=True, max_loras=2)
    handles = build_local_workers(config, num_decode=2, colocated=True)

    async def main():
        router = Router(ModelSpec("t", 256, 509, ()), StaticDirectory(handles), tokenize=list,
                        prefix_cache_salt=SALT)
        await router.start()
        try:
            first = await run(router, "first", PROMPT, sql)
            await router.workers.refresh()  # (the stats now say where sql is)
            again = await run(router, "again", [9, 8, 7, 6, 5], sql)
            await router.workers.refresh()
            other = await run(router, "other", PROMPT, chat)
            base = await run(router, "base", PROMPT)
            await router.workers.refresh()
            return first, again, other, base, generate_latest(router.metrics.registry).decode()
        finally:
            await router.stop()
            for h in handles:
                h.close()

    (tokens, first), (_, again), (_, other), (base_tokens, base), metrics = asyncio.run(main())
    assert tokens == peft_greedy(tiny_dir, adapters[0], [PROMPT], 4)[0]
    assert tokens != base_tokens  # (the adapter changed the output)
    holder = first.prefill_routing.worker_id
    assert (first.adapter, first.prefill_routing.adapter.source, first.adapter_loaded) == \
        ("sql", "disk", True)
    # the second request for sql finds it resident on the first one's worker
    assert again.prefill_routing.worker_id == holder
    assert (again.prefill_routing.adapter.source, again.adapter_loaded) == ("resident", False)
    assert again.prefill_routing.runner_up_cost > again.prefill_routing.cost
    assert other.adapter == "chat" and other.adapter_loaded
    assert (base.adapter, base.adapter_loaded, base.prefill_routing.adapter) == (None, None, None)
    # Admin's trace says the same
    row = trace_dict(trace_pb(again))
    assert (row["adapter"], row["prefill_worker"], row["prefill_adapter_source"],
            row["decode_worker"], row["decode_adapter_source"]) == \
        ("sql", holder, "resident", None, None)
    # what `pdserve status --checklist` counts, from the router's traces or Admin's
    traces = [first, again, other, base]
    assert adapter_loads(traces) == {"resident": 1, "loaded": 2}
    assert adapter_loads([trace_dict(trace_pb(t)) for t in traces]) == adapter_loads(traces)
    assert adapter_loads([base]) is None
    # the metrics: per adapter at the router, per worker from its stats
    assert 'pdserve_lora_requests_total{adapter="sql"} 2.0' in metrics
    assert 'pdserve_lora_requests_total{adapter="chat"} 1.0' in metrics
    assert f'pdserve_lora_slots{{role="colocated",worker="{holder}"}} 2.0' in metrics
    resident = [line for line in metrics.splitlines()
                if line.startswith("pdserve_lora_resident_adapters{")]
    assert sum(float(line.split()[-1]) for line in resident) == 2  # sql and chat, somewhere
    disk = [line for line in metrics.splitlines()
            if line.startswith("pdserve_lora_loads_total{") and 'source="disk"' in line]
    assert sum(float(line.split()[-1]) for line in disk) == 2


def test_a_trace_without_routing_or_adapter_says_so():
    row = trace_dict(trace_pb(RequestTrace("r", 0.1, 0.2)))
    assert (row["adapter"], row["prefill_worker"], row["decode_worker"],
            row["prefill_adapter_source"], row["decode_adapter_source"]) == (None,) * 5
    assert RequestTrace("r", 0.1, 0.2).adapter_loaded is None
    assert RequestTrace("r", 0.1, 0.2, adapter="sql").adapter_loaded is False


def test_a_disaggregated_request_runs_its_adapter_on_both_workers(tiny_dir, adapters):
    """Prefill and decode workers both run the adapter (the prompt's KV under it, the decode
    steps under it): PEFT's tokens; the trace says where the adapter was on each."""
    sql = LLM.adapter(adapters[0])
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=64,
                          prefix_cache_salt=SALT, enable_lora=True, max_loras=2)
    handles = build_local_workers(config, num_prefill=1, num_decode=1)

    async def main():
        router = Router(ModelSpec("t", 256, 509, ()), StaticDirectory(handles), tokenize=list,
                        config=RouterConfig(disaggregation="always"), prefix_cache_salt=SALT)
        await router.start()
        try:
            first = await run(router, "first", PROMPT, sql)
            await router.workers.refresh()
            again = await run(router, "again", PROMPT[:9], sql)
            base = await run(router, "base", PROMPT[:9])
            return first, again, base
        finally:
            await router.stop()
            for h in handles:
                h.close()

    (tokens, first), (_, again), (_, base) = asyncio.run(main())
    assert tokens == peft_greedy(tiny_dir, adapters[0], [PROMPT], 4)[0]
    assert (first.prefill_routing.adapter.source, first.decode_routing.adapter.source) == \
        ("disk", "disk")
    assert (again.prefill_routing.adapter.source, again.decode_routing.adapter.source) == \
        ("resident", "resident")
    assert (first.adapter_loaded, again.adapter_loaded) == (True, False)
    # the router found the prompt's two full blocks under sql's root on both workers; the
    # same tokens for the base model hash apart and match nothing
    assert (again.prefill_routing.hit_blocks, again.decode_routing.hit_blocks) == (2, 2)
    assert (base.prefill_routing.hit_blocks, base.decode_routing.hit_blocks) == (0, 0)
    row = trace_dict(trace_pb(again))
    assert (row["prefill_adapter_source"], row["decode_adapter_source"]) == \
        ("resident", "resident")
    assert row["decode_worker"] == again.decode_routing.worker_id


def test_lora_series_follow_the_workers_stats_and_leave_with_it():
    metrics = RouterMetrics()
    stats = WorkerStats("w0", "colocated", 64, 64, 0, 0, 0, 0, 0, 0, 0, 0, lora_slots=4,
                        lora_resident=("a" * 64,), lora_disk_reads=3, lora_slot_loads=5,
                        lora_evictions=1)
    metrics.set_worker(stats)
    metrics.set_worker(WorkerStats("plain", "colocated", 64, 64, 0, 0, 0, 0, 0, 0, 0, 0))
    text = generate_latest(metrics.registry).decode()
    labels = 'role="colocated",worker="w0"'
    for line in (f"pdserve_lora_slots{{{labels}}} 4.0",
                 f"pdserve_lora_resident_adapters{{{labels}}} 1.0",
                 'pdserve_lora_loads_total{role="colocated",source="disk",worker="w0"} 3.0',
                 'pdserve_lora_loads_total{role="colocated",source="host",worker="w0"} 2.0',
                 f"pdserve_lora_evictions_total{{{labels}}} 1.0"):
        assert line in text
    assert 'worker="plain"' not in "".join(line for line in text.splitlines()
                                           if line.startswith("pdserve_lora"))
    metrics.remove_worker("colocated", "w0")
    text = generate_latest(metrics.registry).decode()
    assert not [line for line in text.splitlines()
                if line.startswith("pdserve_lora") and 'worker="w0"' in line]


def test_adapters_settle_one_worker_each_instead_of_evicting_each_other(tiny_dir, adapters):
    """Four adapters over two workers of two slots each, requested in turn: each worker ends
    up holding two of them, and after each adapter's first load no request loads one again
    (all in one worker's slots, the turns would evict an adapter per request)."""
    refs = [LLM.adapter(path) for path in adapters]
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=64,
                          prefix_cache_salt=SALT, enable_lora=True, max_loras=2)
    handles = build_local_workers(config, num_decode=2, colocated=True)

    async def main():
        router = Router(ModelSpec("t", 256, 509, ()), StaticDirectory(handles), tokenize=list,
                        prefix_cache_salt=SALT)
        await router.start()
        try:
            traces = []
            for turn in range(3):
                for i, ref in enumerate(refs):
                    traces.append((await run(router, f"{turn}-{i}", [3 + i, 5, 7, 9, 11],
                                             ref))[1])
                    await router.workers.refresh()
            return traces, [h.worker.engine.parts.adapters.counters for h in handles]
        finally:
            await router.stop()
            for h in handles:
                h.close()

    traces, counters = asyncio.run(main())
    assert [t.adapter_loaded for t in traces] == [True] * 4 + [False] * 8
    holder = {t.adapter: t.prefill_routing.worker_id for t in traces[:4]}
    assert sorted(holder.values()) == ["colocated-0"] * 2 + ["colocated-1"] * 2
    assert all(t.prefill_routing.worker_id == holder[t.adapter] for t in traces)
    assert [(c.disk_reads, c.slot_loads, c.evictions) for c in counters] == [(2, 2, 0)] * 2
