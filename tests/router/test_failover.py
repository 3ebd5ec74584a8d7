"""Failure paths through the real router and real workers in this process.

A killed worker is a fault-injection wrapper (its calls fail like a dead actor's); an engine
loop is made to raise through ``EngineLoop.inject_fault``. The e2e chaos tests do the same with
SIGKILL on real Ray actors. Every test ends in a leak check on the surviving workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.core import Router, RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.router.errors import DeadlineExceededError, NoWorkersError
from pdserve.router.flight import TRANSITIONS, Flight, Phase
from pdserve.router.metrics import RouterMetrics
from pdserve.router.otel import tracing_settings
from pdserve.router.otel_export import OtlpTracing
from pdserve.testing.draw_check import draw_problems
from pdserve.testing.waits import async_wait_for
from pdserve.workers.build import build_local_workers
from pdserve.workers.host import LocalHandle

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=384, max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True,
                        presence_penalty=0.3)


class KillableHandle:
    """A LocalHandle whose worker can be 'killed': every later call fails like a dead actor."""

    def __init__(self, inner: LocalHandle):
        self.inner = inner
        self.worker_id, self.role, self.worker = inner.worker_id, inner.role, inner.worker
        self.killed = False
        self._pending: set[asyncio.Future] = set()

    def kill(self) -> None:
        self.killed = True
        for call in self._pending:  # in flight calls fail, as a dead actor's do
            call.cancel()
        self.inner.close()

    def close(self) -> None:
        if not self.killed:
            self.inner.close()

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        async def call(*args):
            if self.killed:
                raise ConnectionError(f"{self.worker_id} is dead")
            pending = asyncio.ensure_future(method(*args))
            self._pending.add(pending)
            try:
                result = await pending
            except asyncio.CancelledError:
                if not self.killed:
                    raise
            finally:
                self._pending.discard(pending)
            if self.killed:
                raise ConnectionError(f"{self.worker_id} died during the call")
            return result

        return call


def requests(n: int, max_tokens: int = 16) -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i in range(n):
        prompt = [(7 * i + 3 * j) % 400 + 3 for j in range(5 + 3 * i)]
        params = SEEDED if i % 2 else GREEDY
        out.append((prompt, dataclasses.replace(params, max_tokens=max_tokens + 2 * i)))
    return out


def assert_draws(model_dir, reqs, results) -> None:
    """Every result is its request's draws (``pdserve.testing.draw_check``: the offline tokens up
    to a flip at a float-rounding boundary, since batching and re-prefill change the last bits)."""
    assert [r for r in results if isinstance(r, Exception)] == []
    assert draw_problems(str(model_dir), reqs, results) == []


async def idle_blocks(handles) -> list[int]:
    """Poll the live workers until none owns a block; returns their counts (all 0)."""
    async def idle():
        used = [(await h.inner.stats()).used_blocks for h in handles
                if not h.killed and h.worker.loop.is_alive]
        return used if not any(used) else False

    return await async_wait_for(idle, 10.0, "every live worker's blocks back to 0")


class Cluster:
    """Workers + router in this process."""

    def __init__(self, model_dir, router_config: RouterConfig | None = None,
                 engine: dict | None = None, tracing=None, **build):
        config = EngineConfig(model=str(model_dir), **{**ENGINE, **(engine or {})})
        self.handles = [KillableHandle(h) for h in build_local_workers(config, **build)]
        self.router = Router(ModelSpec("t", 256, 509), StaticDirectory(self.handles, 2.0),
                             tokenize=list, config=router_config or RouterConfig(
                                 stats_interval_s=0.05, worker_wait_s=5.0), tracing=tracing)

    def by_id(self, worker_id: str) -> KillableHandle:
        return next(h for h in self.handles if h.worker_id == worker_id)

    async def one(self, i: int, prompt, params, deadline_s: float | None = None):
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        tokens = []
        try:
            async for delta in self.router.generate(PreparedRequest(
                    f"r{i}", prompt, params, params.max_tokens, deadline)):
                tokens += delta.token_ids
        except (NoWorkersError, DeadlineExceededError) as exc:
            return exc
        return tokens

    def streaming_on(self, worker_id: str) -> list[Flight]:
        return [f for f in self.router._flights.values()
                if f.decode_id == worker_id and f.output_ids and f.phase == Phase.DECODING]

    async def __aenter__(self) -> Cluster:
        await self.router.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.router.stop()
        for h in self.handles:
            h.close()


def run_with_fault(model_dir, fault, router_config=None, tracing=None, **build):
    """Send requests(8) at once; once two streams run on the first streaming worker, apply
    ``fault(cluster, worker_id)``; return (results, victims, survivors' blocks, cluster). The
    victims are the requests the router sees streaming from that worker and, where ``fault``
    returns the set the worker runs, still running there (the router's view lags the worker by
    the deltas it has not polled yet: a request may have finished there already; outputs of
    128 tokens and more keep those it sees streaming running there for many steps after, even
    on a loaded machine with decode steps of a fraction of a millisecond; ENGINE's pool holds
    all eight on one worker)."""
    reqs = requests(8, max_tokens=128)

    async def main():
        async with Cluster(model_dir, router_config, tracing=tracing, **build) as c:
            tasks = [asyncio.create_task(c.one(i, p, params)) for i, (p, params)
                     in enumerate(reqs)]
            role = "colocated" if build.get("colocated") else "decode"
            streaming = [h.worker_id for h in c.handles if h.role == role]
            await async_wait_for(lambda: any(len(c.streaming_on(w)) >= 2 for w in streaming),
                             what="two streams on one worker")
            victim = next(w for w in streaming if len(c.streaming_on(w)) >= 2)
            labels = {f.request_id: f.label for f in c.streaming_on(victim)}  # work id ->
            c.touched = {f.label for f in c.router._flights.values()
                         if victim in (f.decode_id, f.prefill_id)}
            running = fault(c, victim)  # (None: the fault does not say; else work ids)
            victims = {labels[w] for w in labels if running is None or w in running}
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return results, victims, await idle_blocks(c.handles), c

    results, victims, used, c = asyncio.run(main())
    return reqs, results, victims, used, c


def kill(c: Cluster, worker_id: str) -> None:
    c.by_id(worker_id).kill()  # (its undelivered deltas are lost: every stream moves)


def crash_loop(c: Cluster, worker_id: str) -> set[str]:
    """The worker's next step raises; returns the requests it runs then (read on its loop
    thread with the fault set: none of them can finish before the loop dies)."""
    worker = c.by_id(worker_id).worker

    def inject() -> set[str]:
        worker.loop.inject_fault("raise")
        return {seq.request_id for seq in worker.engine.scheduler.running}

    return worker.loop.call(inject).result(5)


@pytest.mark.parametrize("fault", [kill, crash_loop], ids=["killed", "loop-raised"])
def test_decode_failure_mid_stream_migrates_without_a_lost_token(hf_checkpoint, fault):
    """(Traced: each migrated request's OpenTelemetry trace shows the move.)"""
    model_dir = hf_checkpoint("llama")
    spans = InMemorySpanExporter()
    tracing = OtlpTracing(tracing_settings("http://127.0.0.1:9", {}), RouterMetrics(), spans)
    reqs, results, victims, used, c = run_with_fault(
        model_dir, fault, tracing=tracing, num_prefill=1, num_decode=2)
    assert_draws(model_dir, reqs, results)
    assert victims and used == [0, 0]  # the surviving prefill and decode workers
    assert victims <= {t.request_id for t in c.router.traces if t.num_migrations}
    moved = [s for s in spans.get_finished_spans()  # (the span the attempt failed in)
             if any(e.name == "pdserve.migration" for e in s.events)]
    assert len(moved) == sum(t.num_migrations for t in c.router.traces)
    for span in moved:  # failed, and followed in its trace by the next attempt's decode
        assert span.status.status_code.name == "ERROR"
        attempt = span.attributes["pdserve.attempt"]
        assert any(s.name == "decode" and s.context.trace_id == span.context.trace_id
                   and s.attributes["pdserve.attempt"] > attempt
                   for s in spans.get_finished_spans())


@pytest.mark.parametrize("fault", [kill, crash_loop], ids=["killed", "loop-raised"])
def test_a_decode_worker_lost_while_it_prefills_locally_moves_its_requests(hf_checkpoint, fault):
    model_dir = hf_checkpoint("llama")
    config = RouterConfig(stats_interval_s=0.05, worker_wait_s=5.0, disaggregation="never")
    reqs, results, victims, used, c = run_with_fault(model_dir, fault, config, num_prefill=1,
                                                     num_decode=2)
    assert_draws(model_dir, reqs, results)
    assert victims and used == [0, 0]
    assert victims <= {t.request_id for t in c.router.traces if t.num_migrations}
    assert {t.prefill_location.location for t in c.router.traces} == {"local"}


def test_colocated_worker_failure_migrates_to_another(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    reqs, results, victims, used, _ = run_with_fault(model_dir, crash_loop,
                                                     colocated=True, num_decode=2)
    assert_draws(model_dir, reqs, results)
    assert victims and used == [0]


def test_migration_limit_zero_fails_only_the_victims(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    config = RouterConfig(stats_interval_s=0.05, worker_wait_s=5.0, migration_limit=0)
    reqs, results, victims, used, c = run_with_fault(model_dir, kill, config,
                                                     num_prefill=1, num_decode=2)
    for i, result in enumerate(results):
        if f"r{i}" in victims:  # were streaming from the killed worker
            assert isinstance(result, NoWorkersError) and "migration" in str(result)
        elif f"r{i}" not in c.touched:  # elsewhere: unaffected
            assert not isinstance(result, Exception)
        else:  # placed on it but no token streamed yet: retried, or failed if it had
            assert not isinstance(result, Exception) or isinstance(result, NoWorkersError)
    served = [i for i, result in enumerate(results) if not isinstance(result, Exception)]
    assert_draws(model_dir, [reqs[i] for i in served], [results[i] for i in served])
    assert used == [0, 0]


def test_prefill_worker_killed_before_commit_is_retried(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    reqs = requests(6)

    async def main():
        async with Cluster(model_dir, num_prefill=2, num_decode=1,
                           engine=dict(max_num_batched_tokens=8)) as c:
            tasks = [asyncio.create_task(c.one(i, p, params)) for i, (p, params)
                     in enumerate(reqs)]
            await async_wait_for(lambda: any(f.phase == Phase.PREFILLING and f.prefill_id
                                         for f in c.router._flights.values()))
            prefilling = next(f.prefill_id for f in c.router._flights.values()
                              if f.phase == Phase.PREFILLING and f.prefill_id)
            c.by_id(prefilling).kill()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return results, await idle_blocks(c.handles)

    results, used = asyncio.run(main())
    assert_draws(model_dir, reqs, results)
    assert used == [0, 0]


@pytest.mark.parametrize("where", ["queued-at-prefill", "decoding"])
def test_deadline_expiring_fails_the_request_and_frees_every_block(hf_checkpoint, where):
    """Queued: the prefill worker stalls past the deadline. Decoding: a long generation."""
    model_dir = hf_checkpoint("llama")
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        async with Cluster(model_dir, num_prefill=1, num_decode=1) as c:
            stalled = "prefill-0" if where == "queued-at-prefill" else "decode-0"
            c.by_id(stalled).worker.loop.inject_fault("stall", 1.0)  # its next step
            result = await c.one(0, [5, 6, 7, 8], params, deadline_s=0.5)
            return result, await idle_blocks(c.handles)

    result, used = asyncio.run(main())
    assert isinstance(result, DeadlineExceededError)
    assert used == [0, 0]


def test_overload_waits_for_room_and_outlives_the_lease(hf_checkpoint):
    """Decode pool holds ~2 requests, the lease is shorter than the prefill queue: every
    request still completes with the offline engine's tokens."""
    model_dir = hf_checkpoint("llama")
    reqs = [([(5 * i + j) % 300 + 3 for j in range(30)], GREEDY) for i in range(8)]

    async def main():
        async with Cluster(model_dir, num_prefill=1, num_decode=1, lease_s=0.3,
                           engine=dict(num_kv_blocks=24, max_num_batched_tokens=8)) as c:
            c.by_id("prefill-0").worker.loop.inject_fault("stall", 0.6)  # > the lease
            results = await asyncio.wait_for(asyncio.gather(
                *(c.one(i, p, params) for i, (p, params) in enumerate(reqs))), 120)
            return results, await idle_blocks(c.handles)

    results, used = asyncio.run(main())
    assert_draws(model_dir, reqs, results)
    assert used == [0, 0]


def test_overload_colocated_completes_everything(hf_checkpoint):
    model_dir = hf_checkpoint("llama")
    reqs = [([(5 * i + j) % 300 + 3 for j in range(30)], GREEDY) for i in range(8)]

    async def main():
        async with Cluster(model_dir, colocated=True, num_decode=1,
                           engine=dict(num_kv_blocks=24, max_num_batched_tokens=8)) as c:
            c.by_id("colocated-0").worker.loop.inject_fault("stall", 0.6)
            results = await asyncio.wait_for(asyncio.gather(
                *(c.one(i, p, params) for i, (p, params) in enumerate(reqs))), 120)
            return results, await idle_blocks(c.handles)

    results, used = asyncio.run(main())
    assert_draws(model_dir, reqs, results)
    assert used == [0]

def test_stale_attempt_deltas_are_dropped():
    from pdserve.worker_api import RequestDelta, WorkRequest

    router = Router(ModelSpec("t", 256, 509), StaticDirectory([]), tokenize=list)
    flight = Flight(WorkRequest("x", [1], GREEDY, 1, 0.0))
    flight.move_to(Phase.PLACING)
    flight.decode_id = "d"
    flight.next_attempt()
    flight.decode_id = "d"
    router._flights["x"] = flight
    handle = type("H", (), {"worker_id": "d"})()
    router._route(handle, RequestDelta("x", [9], "", error="old attempt", attempt=1))
    router._route(handle, RequestDelta("x", [5], "", attempt=2))
    assert flight.queue.qsize() == 1 and flight.queue.get_nowait().new_token_ids == [5]


def test_transitions_outside_the_table_are_refused():
    from pdserve.worker_api import WorkRequest

    flight = Flight(WorkRequest("x", [1], GREEDY, 1, 0.0))
    with pytest.raises(RuntimeError, match="ADMITTED -> DECODING"):
        flight.move_to(Phase.DECODING)
    assert all(Phase.DONE in TRANSITIONS[p] for p in Phase if p != Phase.DONE)


def test_deltas_that_beat_the_submit_reply_are_not_lost(hf_checkpoint):
    """A colocated worker may stream a whole short request before its submit call returns
    (slow reply here): every token must still reach the client."""
    model_dir = hf_checkpoint("llama")
    reqs = requests(3)

    async def main():
        async with Cluster(model_dir, colocated=True, num_decode=1) as c:
            inner = c.handles[0].inner
            submit = inner.submit

            async def slow_reply(request):
                await submit(request)
                await asyncio.sleep(0.3)  # the worker finishes meanwhile

            inner.submit = slow_reply
            results = await asyncio.wait_for(asyncio.gather(
                *(c.one(i, p, params) for i, (p, params) in enumerate(reqs))), 60)
            return results, await idle_blocks(c.handles)

    results, used = asyncio.run(main())
    assert_draws(model_dir, reqs, results)
    assert used == [0]
