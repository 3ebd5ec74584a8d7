"""No ready worker is a wait, not an error (real router, real workers in this process):
requests sent before any worker is ready wait, as many as the admission limits allow, and
finish with their tokens once workers come up; a deadline or ``worker_wait_s`` shorter than
the wait fails them saying what was missing."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.core import Router, RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.router.errors import DeadlineExceededError, NoWorkersError, QueueFullError
from pdserve.testing.draw_check import draw_problems
from pdserve.testing.waits import async_wait_for
from pdserve.workers.build import build_local_workers

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
WAITING = "pdserve_router_requests_waiting_for_workers"


async def collect(router: Router, request_id: str, prompt: list[int],
                  deadline_s: float | None = None) -> list[int]:
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    return [t async for d in router.generate(PreparedRequest(
        request_id, prompt, GREEDY, GREEDY.max_tokens, deadline))
            for t in d.token_ids]


def make_router(directory: StaticDirectory, **config) -> Router:
    return Router(ModelSpec("t", 256, 509), directory, tokenize=list,
                  config=RouterConfig(stats_interval_s=0.05, **config))


def test_requests_wait_for_workers_and_finish_once_they_come(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    handles = build_local_workers(EngineConfig(model=str(model_dir), **ENGINE))
    directory = StaticDirectory([])  # start-up: no worker registered yet
    router = make_router(directory, max_requests_in_flight=4)
    prompts = [[3 + i, 7, 9, 11 + i] for i in range(4)]

    async def main():
        await router.start()
        try:
            tasks = [asyncio.create_task(collect(router, f"r{i}", p))
                     for i, p in enumerate(prompts)]
            await async_wait_for(lambda: router.metrics.registry.get_sample_value(WAITING) == 4,
                                 10, "four requests waiting for workers")
            with pytest.raises(QueueFullError):  # the admission limit bounds how many wait
                await collect(router, "r-extra", [5, 6])
            directory.handles.extend(handles)  # the workers come up
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            await router.stop()
            for handle in handles:
                handle.close()

    results = asyncio.run(main())
    assert draw_problems(str(model_dir), [(p, GREEDY) for p in prompts], results) == []
    assert router.metrics.registry.get_sample_value(WAITING) == 0


def test_a_short_deadline_or_worker_wait_fails_saying_what_was_missing(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    handles = build_local_workers(EngineConfig(model=str(model_dir), **ENGINE))
    prefill = [h for h in handles if h.role == "prefill"]

    async def main():
        router = make_router(StaticDirectory([]), worker_wait_s=0.3)
        only_prefill = make_router(StaticDirectory(prefill), worker_wait_s=30)
        await router.start()
        await only_prefill.start()
        try:
            with pytest.raises(NoWorkersError, match=r"no worker is ready .*worker_wait_s 0.3"):
                await collect(router, "a", [5, 6])
            with pytest.raises(DeadlineExceededError, match="no worker is ready"):
                await collect(router, "b", [5, 6], deadline_s=0.2)
            with pytest.raises(DeadlineExceededError, match="no decode worker is ready"):
                await collect(only_prefill, "c", [5, 6], deadline_s=0.3)
        finally:
            await router.stop()
            await only_prefill.stop()
            for handle in handles:
                handle.close()

    asyncio.run(main())
