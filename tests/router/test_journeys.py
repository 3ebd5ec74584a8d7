"""Random request journeys through the real router and real workers in this process.

One generator (:func:`journey`) draws a burst of requests: prompts that share prefixes (so
both pools' prefix caches hit) or not, client labels drawn from a few (so several requests
share one), greedy or seeded sampling, and for each an end: it finishes, its client cancels
it after some tokens, its client disconnects at a random moment (in any phase: admission,
placing, prefill, decode), or its deadline runs out. A journey may also kill a decode worker
while streams run. Each set-up below runs journeys of a few seeds: chunked prefill with and
without a sliding window, conditional disaggregation ("auto" and "always"), int8 KV,
colocated, two routers sharing the workers (the same labels on both), and a decode pool small
enough that full decode workers hand requests back (bounces).

Then, whatever happened: every completed stream is its request's draws
(``pdserve.testing.draw_check``: the reference model's tokens, up to flips at rounding
boundaries), every other request ended with a clear status (cancelled, deadline, or a router
error), and nothing is left: no flight and no budget token on the router, no block owned and
no owner entry on any live worker, no target on a prefill worker.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import pytest

from pdserve import SamplingParams
from pdserve.router.backend import ModelSpec, PreparedRequest, end_stream
from pdserve.router.core import Router, RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.router.errors import (
    DeadlineExceededError,
    NoWorkersError,
    QueueFullError,
    RequestTooLargeError,
)
from pdserve.testing.draw_check import draw_problems
from pdserve.testing.waits import async_wait_for

from .test_failover import Cluster, idle_blocks

ENDS = ("finish", "finish", "finish", "cancel", "disconnect", "deadline")
LABELS = ("a", "b", "c", "")


@dataclass
class Step:
    """One request of a journey and how its client ends it."""

    label: str  # the client's id ("" = none given): a few, so several requests share one
    prompt: list[int]
    params: SamplingParams
    start_s: float  # when it is sent, after the journey starts
    end: str  # one of ENDS
    after: float  # cancel: after this many tokens; disconnect/deadline: after this many s
    router: int  # which of the journey's routers it is sent to


def journey(rng: random.Random, num_requests: int) -> list[Step]:
    """A burst of requests with shared prefixes, shared labels and random ends."""
    prefixes = [[rng.randrange(3, 400) for _ in range(n)] for n in (20, 33)]  # > window + chunk
    steps = []
    for _ in range(num_requests):
        # in waves: later prompts, short past their prefix, read blocks that earlier, longer
        # ones left in the prefix caches (within the window, where a wrong block shows)
        start_s = rng.choice((0.0, 0.8, 1.6))
        tail = [rng.randrange(3, 400) for _ in range(rng.choice((1, 2, 3) if start_s else
                                                                (5, 11)))]
        prompt = rng.choice(prefixes + [[]]) + tail
        seeded = rng.random() < 0.4
        params = SamplingParams(max_tokens=rng.randrange(3, 14), ignore_eos=True,
                                temperature=0.8 if seeded else 0.0,
                                seed=rng.randrange(1 << 30) if seeded else None)
        end = rng.choice(ENDS)
        after = {"cancel": rng.randrange(1, 3), "disconnect": rng.uniform(0.0, 0.4),
                 "deadline": rng.uniform(0.05, 0.6)}.get(end, 0.0)
        steps.append(Step(rng.choice(LABELS), prompt, params, start_s, end, after,
                          rng.randrange(2)))
    return steps


async def run_step(routers: list[Router], step: Step) -> tuple[str, object]:
    """(how it ended, its tokens or the error)."""
    await asyncio.sleep(step.start_s)
    deadline = time.monotonic() + step.after if step.end == "deadline" else None
    router = routers[step.router % len(routers)]
    stream = router.generate(PreparedRequest(step.label, step.prompt, step.params,
                                            step.params.max_tokens, deadline))
    tokens: list[int] = []
    try:
        async for delta in stream:
            tokens += delta.token_ids
            if step.end == "cancel" and len(tokens) >= step.after:
                return "cancelled", tokens
        return "done", tokens
    except DeadlineExceededError as exc:
        return "deadline", exc
    except NoWorkersError as exc:  # a killed worker's request past its migrations
        return "failed", exc
    except (QueueFullError, RequestTooLargeError) as exc:  # no room, now or ever
        return "refused", exc
    finally:
        await end_stream(stream)


async def run_journey(c: Cluster, routers: list[Router], steps: list[Step],
                      kill_at: float | None):
    tasks = [asyncio.create_task(run_step(routers, step)) for step in steps]
    for step, task in zip(steps, tasks, strict=True):
        if step.end == "disconnect":  # the door's task is cancelled, in whatever phase
            asyncio.get_running_loop().call_later(step.start_s + step.after, task.cancel)
    if kill_at is not None:
        await asyncio.sleep(kill_at)
        victim = next(h for h in c.handles if h.role in ("decode", "colocated"))
        victim.kill()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [("disconnected", r) if isinstance(r, asyncio.CancelledError) else r
            for r in results]


async def check_nothing_left(c: Cluster, routers: list[Router]) -> None:
    def routers_empty() -> bool:
        return all(not r._flights and r._tokens_in_flight == 0 for r in routers)

    await async_wait_for(routers_empty, 10.0, "no router to hold a flight or a budget token")
    await idle_blocks(c.handles)
    live = [h for h in c.handles if not h.killed]

    def no_owner() -> bool:
        return all(h.worker.mailbox_sizes().num_owned == 0 for h in live
                   if h.role != "prefill")

    await async_wait_for(no_owner, 10.0, "no owner entry left on any worker")
    assert all(not h.worker._targets for h in live if h.role == "prefill")


# name: (family, engine settings, workers, disaggregation, kill a worker, draw tolerance,
# routers)
SETUPS = {
    "chunked-auto-2d-kill": ("llama", {}, dict(num_decode=2), "auto", True, 1e-4, 1),
    "window-always": ("mistral", {}, {}, "always", False, 1e-4, 1),
    "window-auto": ("mistral", {}, {}, "auto", False, 1e-4, 1),
    # int8 KV moves the logits off the float model's by more than a draw's margin, and with
    # the batches that timing makes, off the offline int8 engine's too: its journeys check
    # endings and leaks only (tests/workers/test_disagg_inproc.py checks its tokens exactly)
    "int8-always": ("llama", dict(kv_cache_dtype="int8", kv_int8_keep_edge_layers=False,
                                  kv_int8_scales="kivi"), {}, "always", False, None, 1),
    "colocated-kill": ("llama", {}, dict(colocated=True, num_decode=2), "auto", True, 1e-4, 1),
    "two-routers": ("llama", {}, dict(num_decode=2), "auto", False, 1e-4, 2),
    "two-routers-colocated": ("llama", {}, dict(colocated=True), "auto", False, 1e-4, 2),
    "small-decode-pool": ("llama", dict(num_kv_blocks=24), {}, "always", False, 1e-4, 1),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_random_journeys_end_right_and_leave_nothing(hf_checkpoint, setup, seed):
    family, engine, build, mode, kill, tolerance, num_routers = SETUPS[setup]
    model_dir = hf_checkpoint(family)
    rng = random.Random(f"{setup}-{seed}")
    steps = journey(rng, 14)
    config = RouterConfig(stats_interval_s=0.05, worker_wait_s=5.0, disaggregation=mode)

    async def main():
        async with Cluster(model_dir, config, dict(max_num_batched_tokens=8, **engine),
                           **build) as c:
            routers = [c.router] + [
                Router(ModelSpec("t", 256, 509), StaticDirectory(
                    [h.inner.for_router(f"router-{i}") for h in c.handles], 2.0),
                    tokenize=list, config=config) for i in range(1, num_routers)]
            for router in routers[1:]:
                await router.start()
            try:
                results = await run_journey(c, routers, steps,
                                            rng.uniform(0.2, 0.6) if kill else None)
                await check_nothing_left(c, routers)
            finally:
                for router in routers[1:]:
                    await router.stop()
            return results

    results = asyncio.run(main())
    kinds = {"done", "cancelled", "deadline", "failed", "refused", "disconnected"}
    assert all(not isinstance(r, BaseException) and r[0] in kinds for r in results), results
    done = [(step, r[1]) for step, r in zip(steps, results, strict=True) if r[0] == "done"]
    assert done, "no request of the journey completed"
    for step, tokens in done:
        assert len(tokens) == step.params.max_tokens
    if tolerance is not None:
        assert draw_problems(str(model_dir), [(s.prompt, s.params) for s, _ in done],
                             [t for _, t in done], tolerance) == []
    cancelled = [r for r in results if r[0] == "cancelled"]
    assert all(r[1] for r in cancelled)  # (each saw the tokens it waited for)
