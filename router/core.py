"""The router core: admission, pairing, the per-request state machine, streaming, failover.

Per request, as ``Router.generate`` drives it (states and transitions: ``router.flight``); it
takes the ``PreparedRequest`` either front door made (``router.prepare``):

1. ADMITTED: bounded by requests and prompt tokens in flight (QueueFullError when full),
   whether or not workers are ready: the admission bounds are what bound how many wait.
   Prompt + max_tokens past ``max_request_kv_fraction`` of the largest worker's KV blocks is
   RequestTooLargeError, unless the client set no max_tokens: then it is lowered to fit
   (checked again at placing when no worker was known yet).
2. PLACING waits first for ready workers (a colocated one, or a prefill and a decode one:
   start-up, a pool being replaced), up to the request's deadline (DeadlineExceededError) or
   ``worker_wait_s`` (NoWorkersError), each saying what was missing. Then
   (``router.placement``; disaggregated) the best decode worker
   (``pairing.rank_decode``) reserves blocks under a lease; one without room is skipped; when
   none has room the request waits (up to its deadline, or ``reserve_wait_s``) instead of
   failing; a request no decode worker could ever hold -> RequestTooLargeError. (Colocated:
   ``submit`` to the colocated worker of least prefill cost, ``pairing.rank_prefill``.)
   Before that, conditional disaggregation (``RouterConfig.disaggregation``,
   ``pairing.prefill_location``) may choose to prefill on the decode worker itself: the
   request is then ``submit``-ted to it as to a colocated worker, and skips PREFILLING.
3. PREFILLING: the best prefill worker (``pairing.rank_prefill``) computes the prompt, ships
   the KV into the reservation and returns token 0, streamed at once (TTFT). While the call is
   pending the router renews the reservation's lease, so a prompt queued behind others at the
   prefill worker never loses its blocks.
4. DECODING: the decode worker's deltas arrive through one poller per worker and are routed
   by the attempt's work id into the request's queue; the stream ends with the delta
   carrying finish_reason.
5. MIGRATING: any failure of the attempt (a worker died, its engine loop died, a lease or
   transfer failed, a call timed out) aborts both workers of the attempt and starts a new one
   that resumes after the tokens already streamed; ``max_attempts`` bounds retries before the
   first token, ``migration_limit`` moves after it; past them -> NoWorkersError (UNAVAILABLE).
   A request that made a worker's step fail (a ``faulted`` delta, ``RequestFaultError`` from
   a prefill) is not moved: it fails alone -> RequestFailedError (INTERNAL).
6. DONE: normal finish, or ``abort`` (client cancel, deadline, server stop), which reaches
   both workers of the current attempt (idempotent, bounded by ``rpc_timeout_s``).

Identity (``router.flight``): every request gets ids this router makes, a uid and a work id per
attempt, and every table here and on the workers keys on them; the client's id is a label,
echoed and logged. So two requests with one label (through one door or both) are two requests,
and the flight table and the budgets count each once, whatever the interleaving.

Every await on a worker is bounded by a timeout from the config and the request's deadline;
the deadline also travels in ``WorkRequest`` so workers drop expired work themselves.
Which workers there are, their load, their pollers and what losing one means live in
``router.workers``: a worker that leaves the registry stops receiving new requests, but streams
on it go on until its poll fails, so liveness never depends on step time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from pdserve.router.admission import AdmissionQueue
from pdserve.router.backend import GenerationDelta, ModelSpec, PreparedRequest
from pdserve.router.config import RouterConfig
from pdserve.router.constraints import ConstraintCheck, ConstraintChecker, ConstraintRefused
from pdserve.router.directory import WorkerDirectory
from pdserve.router.errors import (
    DeadlineExceededError,
    NoWorkersError,
    QueueFullError,
    RequestFailedError,
    RequestTooLargeError,
)
from pdserve.router.flight import AttemptFailed, Flight, Phase, new_uid, work_id
from pdserve.router.metrics import RouterMetrics
from pdserve.router.otel import RequestTimeline, RequestTracing
from pdserve.router.pairing import (
    DecodeRouting,
    PrefillLocation,
    PrefillRouting,
    TransferCost,
    WorkerLoad,
    prefill_location,
    rank_decode,
    rank_prefill,
)
from pdserve.router.placement import Placer
from pdserve.router.trace import RequestTrace, observe
from pdserve.router.workers import Workers
from pdserve.worker_api import (
    PrefillResult,
    RequestDelta,
    RequestFaultError,
    Reservation,
    WorkerHandle,
    WorkRequest,
    split_choice,
)
from pdserve.worker_api.sampling_params import StructuredOutputs

__all__ = ["RequestTrace", "Router", "RouterConfig"]

TOKENIZER_THREADS = 2  # prompts tokenized at once (a long one cannot block the others' turn)
ANSWER_BEFORE_DEADLINE_S = 0.25  # a request waiting for workers gives up this long before its
# deadline, so its DEADLINE_EXCEEDED carries the reason before the client's own timer fires

logger = logging.getLogger(__name__)


class Router:
    """Implements the gRPC front door's GenerationBackend over worker handles."""

    def __init__(self, spec: ModelSpec, directory: WorkerDirectory,
                 tokenize: Callable[[str], list[int]], config: RouterConfig | None = None,
                 metrics: RouterMetrics | None = None, prefix_cache_salt: str | None = None,
                 constraints: ConstraintChecker | None = None,
                 tracing: RequestTracing | None = None):
        """``prefix_cache_salt``: the workers' (``EngineConfig.prefix_cache_salt``), so the
        router hashes a prompt's blocks as their prefix caches do and finds the prefill worker
        that holds most of it (None: the queues alone choose). ``constraints`` compiles
        requests' structured outputs before any worker sees them (None: the workers alone
        check them; the router owns and closes it). ``tracing`` makes each request's
        OpenTelemetry spans (``router.otel.build_tracing``; None: off, the router owns and
        shuts it down)."""
        self.spec = spec
        self._constraints = constraints
        self._tracing = tracing
        self._salt = None if prefix_cache_salt is None else prefix_cache_salt.encode()
        self._prefill_turns = itertools.count()  # prefill_routing round-robin
        self._transfer_cost = TransferCost()  # KV block transfer vs prompt token prefill
        self._tokenize = tokenize
        self.config = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        self.workers = Workers(directory, self.config, self.metrics, self._route,
                               self._fail_attempts_on)
        self._flights: dict[str, Flight] = {}  # by the current attempt's work id
        self._orphans: OrderedDict[str, None] = OrderedDict()  # unknown ids already aborted
        self._tokens_in_flight = 0
        self._room = asyncio.Event()  # set whenever a request leaves (blocks came back)
        self._queue = AdmissionQueue(self.config.scheduling_policy, self.config.priority_aging_s,
                                     wake=self._room.set)
        self._placer = Placer(self.config, self.workers, self._queue, self._room)
        self.traces: deque[RequestTrace] = deque(maxlen=100_000)
        # prompts are tokenized on threads of their own, never on the loop's default pool that
        # the worker directory's refresh (Redis) runs on
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS,
                                                  thread_name_prefix="pdserve-tokenize")

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.workers.start()

    async def stop(self) -> None:
        await self.workers.stop()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        if self._constraints is not None:
            self._constraints.close()
        if self._tracing is not None:
            await asyncio.to_thread(self._tracing.shutdown)

    @property
    def mode(self) -> str:
        return "colocated" if self.workers.live("colocated") and not self.workers.live("decode") \
            else "disaggregated"

    # -- GenerationBackend --------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self.workers.is_ready()

    def model_info(self) -> ModelSpec:
        return self.spec

    async def tokenize(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, self._tokenize, text)

    async def check_constraint(self, outputs: StructuredOutputs) -> ConstraintCheck | None:
        if self._constraints is None:
            return None
        try:
            check = await self._constraints.check(outputs)
        except ConstraintRefused as exc:
            self.metrics.observe_constraint_check(exc.check, exc)
            raise
        self.metrics.observe_constraint_check(check, None)
        return check

    async def generate(self, request: PreparedRequest) -> AsyncIterator[GenerationDelta]:
        tracing = self._tracing
        timeline = None if tracing is None else self._timeline(request)
        finished, failure, finish_reason = False, None, None
        num_left = num_seqs = request.params.num_sequences  # sequences still to finish
        try:
            flight = self._admit(request, timeline)
        except Exception as exc:
            if tracing is not None and timeline is not None:
                tracing.finish(timeline, exc, 0, None)
            raise
        try:
            async for delta in self._run(flight):
                num_left -= delta.finish_reason is not None
                finished = num_left == 0  # (closed after it: no abort)
                finish_reason = delta.finish_reason or finish_reason
                if timeline is not None:
                    timeline.delta(delta, flight.prefill_routing)
                trace = observe(flight, delta, self.metrics, finished)
                if trace is not None:
                    if request.constraint_check is not None:
                        trace.grammar_compile_s = request.constraint_check.compile_s
                        trace.grammar_cache_hit = request.constraint_check.cached
                    self.traces.append(trace)
                index = split_choice(delta.request_id)[1] if num_seqs > 1 else 0
                yield GenerationDelta(delta.new_token_ids, delta.text, delta.logprobs,
                                      delta.finish_reason, delta.prompt_logprobs, index)
                if finished:
                    return
        except BaseException as exc:  # (GeneratorExit: the door closed the stream)
            failure = exc
            raise
        finally:
            try:
                if not finished:  # closed early: cancelled, failed, or the client went away
                    await asyncio.shield(self._abort_attempt(flight))
            finally:
                self._release(flight)
                if tracing is not None and timeline is not None:
                    tracing.finish(timeline, None if finished else failure,
                                   len(flight.output_ids), finish_reason)

    def _timeline(self, request: PreparedRequest) -> RequestTimeline:
        """What the request's trace will be made of (tracing is on)."""
        model = request.adapter.name if request.adapter is not None else self.spec.model_name
        return RequestTimeline(request.origin, model, len(request.prompt_token_ids),
                               request.params.max_tokens, request.params.temperature)

    # -- admission ----------------------------------------------------------------------------
    def _admit(self, prepared: PreparedRequest, timeline: RequestTimeline | None) -> Flight:
        cfg, n, params = self.config, len(prepared.prompt_token_ids), prepared.params
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        flight = Flight(WorkRequest(work_id(new_uid(), 1), list(prepared.prompt_token_ids),
                                    params, seed, time.time(), adapter=prepared.adapter),
                        prepared.label,
                        prepared.deadline, tenant=prepared.tenant,
                        max_tokens=prepared.max_tokens, timeline=timeline)
        if timeline is not None:
            timeline.admitted_at, timeline.uid = flight.arrival, flight.uid
        self._check_kv_cap(flight)
        if len(self._flights) >= cfg.max_requests_in_flight \
                and not self._queue.shed_worst(self._queue.key(flight)):
            raise QueueFullError(
                f"{len(self._flights)} requests in flight (the limit) and none waiting ranks "
                f"below this one; retry in {self._queue.retry_after_s():.0f} s",
                retry_after_s=self._queue.retry_after_s())
        if self._tokens_in_flight + n > cfg.max_tokens_in_flight:
            raise QueueFullError(f"{self._tokens_in_flight} prompt tokens in flight; retry",
                                 retry_after_s=self._queue.retry_after_s())
        flight.request.deadline = flight.wall_deadline()
        self._flights[flight.request_id] = flight
        self._tokens_in_flight += n
        self.metrics.router_running.labels("router").set(len(self._flights))
        self.metrics.observe_adapter(prepared.adapter)
        return flight

    def _check_kv_cap(self, flight: Flight) -> None:
        """Refuse a request that would hold more than ``max_request_kv_fraction`` of the
        largest decode (or colocated) worker's KV blocks, before it evicts anyone; when the
        client set no max_tokens (``flight.max_tokens`` None) lower it to fit instead.
        Without live workers it waits for them: placing checks again (idempotent)."""
        fraction = self.config.max_request_kv_fraction
        pools = self.workers.live("decode") or self.workers.live("colocated")
        if fraction >= 1 or not pools:
            return
        largest = max(pools, key=lambda w: w.stats.total_blocks)
        request = flight.request
        num_seqs = request.params.num_sequences  # (n > 1: the prompt once, outputs each)
        tokens = len(request.prompt_token_ids) + num_seqs * request.params.max_tokens
        needed, allowed = largest.blocks_for(tokens), int(fraction * largest.stats.total_blocks)
        room = (allowed * largest.block_size - len(request.prompt_token_ids)) // num_seqs
        if needed > allowed and flight.max_tokens is None and room >= 1:
            request.params = dataclasses.replace(request.params, max_tokens=room)
        elif needed > allowed:
            raise RequestTooLargeError(
                f"prompt + {'max_tokens' if num_seqs == 1 else f'{num_seqs} x max_tokens'} "
                f"({tokens} tokens) needs {needed} KV blocks, more than "
                f"max_request_kv_fraction {fraction:g} of a worker's {largest.stats.total_blocks} "
                f"blocks ({allowed}); shorten the prompt or max_tokens")

    def _release(self, flight: Flight) -> None:
        """The flight leaves: its budget comes back once, however often this runs."""
        if self._flights.get(flight.request_id) is flight:
            del self._flights[flight.request_id]
            self._tokens_in_flight -= len(flight.request.prompt_token_ids)
        flight.phase = Phase.DONE
        self._room.set()
        self.metrics.router_running.labels("router").set(len(self._flights))

    async def _abort_attempt(self, flight: Flight) -> None:
        """Abort the current attempt on both of its workers (idempotent, bounded)."""
        ids = {w for w in (flight.prefill_id, flight.decode_id) if w is not None}
        await asyncio.gather(*(self.workers.abort_on(w, flight.request_id) for w in ids))

    # -- attempts -----------------------------------------------------------------------------
    async def _run(self, flight: Flight) -> AsyncIterator[RequestDelta]:
        """Attempts until one finishes the request; each failure moves it to new workers."""
        while True:
            flight.move_to(Phase.PLACING)
            if flight.timeline is not None:
                flight.timeline.attempt(flight.attempt)
            await self._wait_for_workers(flight)
            if not flight.output_ids:
                self._check_kv_cap(flight)  # the pools may have been unknown at admission
            attempt = self._colocated if self.mode == "colocated" else self._disaggregated
            try:
                async for delta in attempt(flight):
                    flight.output_ids += delta.new_token_ids
                    yield delta
                return
            except AttemptFailed as failure:
                if flight.timeline is not None:
                    flight.timeline.failed(_failure_kind(flight, failure), failure.reason,
                                           str(failure))
                await self._abort_attempt(flight)
                self._count_failure(flight, failure)
                level = logging.INFO if failure.reason == "preempted" else logging.WARNING
                logger.log(level, "%s: attempt %d failed (%s); moving it: %s",
                           flight.name, flight.attempt, failure.reason, failure)
                self._next_attempt(flight)

    def _next_attempt(self, flight: Flight) -> None:
        """Start the flight's next attempt under its new work id."""
        del self._flights[flight.request_id]
        flight.next_attempt()
        self._flights[flight.request_id] = flight

    def _count_failure(self, flight: Flight, failure: AttemptFailed) -> None:
        """Raise NoWorkersError when this failure spends the request's last attempt, or when
        it would move a request forked into several sequences (``n``/``best_of`` > 1) after
        tokens streamed: those never resume elsewhere (a worker refuses them)."""
        cfg = self.config
        if flight.output_ids and flight.request.params.num_sequences > 1:
            raise NoWorkersError(f"{failure}; a request of n or best_of > 1 cannot move to "
                                 f"another worker once its tokens have streamed")
        if failure.reason == "preempted":  # a full decode worker handed it back: not a fault
            if flight.num_bounces >= cfg.max_bounces:
                raise QueueFullError(
                    f"{flight.name} was handed back {flight.num_bounces + 1} times for "
                    f"lack of KV room (max_bounces {cfg.max_bounces}); the decode pool is "
                    f"full, retry later", retry_after_s=self._queue.retry_after_s())
            flight.num_bounces += 1
            self.metrics.migrations.labels(failure.reason).inc()
            return
        if not flight.output_ids:
            flight.num_retries += 1
            if flight.num_retries >= cfg.max_attempts:
                raise NoWorkersError(f"{failure} (after {flight.num_retries} attempts)")
            return
        if flight.num_migrations >= cfg.migration_limit:
            spent = ("migration is off (migration_limit 0)" if cfg.migration_limit == 0
                     else f"its {cfg.migration_limit} migrations are spent")
            raise NoWorkersError(f"{failure}; the request cannot move on: {spent}")
        flight.num_migrations += 1
        self.metrics.migrations.labels(failure.reason).inc()

    async def _disaggregated(self, flight: Flight) -> AsyncIterator[RequestDelta]:
        flight.prefill_location = self._prefill_location(flight)
        self.metrics.prefill_location.labels(flight.prefill_location.location).inc()
        if flight.prefill_location.location == "local":
            flight.prefill_routing = None
            await self._place_on_decode(flight, self._submit)
            flight.move_to(Phase.DECODING)
            async for delta in self._drain(flight):
                yield delta
            return
        reservation = await self._reserve(flight)
        flight.move_to(Phase.PREFILLING)
        result = await self._prefill(flight, reservation)
        self._transfer_cost.observe(len(_attempt_tokens(flight)) - result.num_cached_tokens,
                                    result.prefill_time_s,
                                    reservation.num_blocks - reservation.num_cached_blocks,
                                    result.transfer_time_s)
        if flight.trace is None:
            flight.trace = RequestTrace(flight.label or flight.uid, 0.0, 0.0,
                                        result.queue_time_s,
                                        result.prefill_time_s, result.transfer_time_s,
                                        prefill_routing=flight.prefill_routing,
                                        prefill_location=flight.prefill_location,
                                        decode_routing=flight.decode_routing,
                                        decode_cached_blocks=reservation.num_cached_blocks,
                                        prefix_source=result.prefix_source,
                                        decode_prefix_source=reservation.prefix_source,
                                        prefill_grammar_compile_s=result.grammar_compile_s,
                                        prefill_grammar_cache_hit=result.grammar_cache_hit,
                                        decode_grammar_compile_s=reservation.grammar_compile_s,
                                        decode_grammar_cache_hit=reservation.grammar_cache_hit)
        flight.move_to(Phase.DECODING)
        yield result.first
        num_finished = result.first.finish_reason is not None
        if num_finished < flight.request.params.num_sequences:  # (n > 1: forks decode on)
            async for delta in self._drain(flight, num_finished):
                yield delta
        else:
            await self.workers.abort_on(reservation.worker_id, flight.request_id)

    async def _colocated(self, flight: Flight) -> AsyncIterator[RequestDelta]:
        def keep(routing: PrefillRouting) -> None:  # a colocated worker prefills
            flight.prefill_routing = routing

        await self._place_ranked(flight, "colocated", self._rank_prefill, self._submit, keep)
        flight.move_to(Phase.DECODING)
        async for delta in self._drain(flight):
            if delta.prefill_time_s is not None:  # its first token: the prefill's speed
                self._observe_prefill_speed(flight, delta.prefill_time_s)
            yield delta

    def _observe_prefill_speed(self, flight: Flight, prefill_s: float) -> None:
        """A colocated worker's prefill time per token, which turns LoRA adapter load times
        into prompt tokens (``pairing.AdapterCost.tokens``) as remote prefills' do."""
        load = self.workers.loads.get(flight.decode_id or "")
        if load is not None:
            self._transfer_cost.observe(self._uncached_tokens(flight, load), prefill_s, 0, 0)

    # -- placing ------------------------------------------------------------------------------
    async def _wait_for_workers(self, flight: Flight) -> None:
        """Wait until workers are ready (see the module docstring, step 2)."""
        if self.workers.is_ready():
            return
        self.metrics.waiting_for_workers.inc()
        try:
            await self._wait_ready_or_fail(flight)
        finally:
            self.metrics.waiting_for_workers.dec()

    async def _wait_ready_or_fail(self, flight: Flight) -> None:
        started, limit = time.monotonic(), self.config.worker_wait_s
        while not self.workers.is_ready():
            now = time.monotonic()
            waited = now - started
            if waited >= limit:
                raise NoWorkersError(
                    f"{self._missing_workers()} for {waited:.0f} s (worker_wait_s {limit:g}): "
                    f"the pools are starting or being replaced; retry later, or let requests "
                    f"wait longer with --worker-wait-s")
            # answered a moment before the deadline, so the client hears why
            left = math.inf if flight.deadline is None else flight.deadline - now
            if left <= ANSWER_BEFORE_DEADLINE_S:
                raise DeadlineExceededError(
                    f"the request's deadline came after {waited:.1f} s waiting: "
                    f"{self._missing_workers()} (the pools are starting or being replaced); "
                    f"retry once health reports SERVING, or give it a longer deadline")
            # re-checked every stats interval: readiness changes at a directory refresh
            await self.workers.wait_ready(min(limit - waited, left - ANSWER_BEFORE_DEADLINE_S,
                                              self.config.stats_interval_s))

    def _missing_workers(self) -> str:
        if self.workers.live("prefill") and not self.workers.live("decode"):
            return "no decode worker is ready"
        if self.workers.live("decode") and not self.workers.live("prefill"):
            return "no prefill worker is ready"
        return "no worker is ready"

    def _prefill_location(self, flight: Flight) -> PrefillLocation:
        """Where this attempt's prompt is computed: as ``disaggregation`` says, or with
        "auto" by ``pairing.prefill_location`` against the decode worker placing would try
        first and the prefill worker of least cost."""
        mode = self.config.disaggregation
        decodes, prefills = self.workers.live("decode"), self.workers.live("prefill")
        if mode != "auto" or not decodes:  # (no decode worker: placing waits for one)
            return PrefillLocation("local" if mode == "never" else "remote")
        decode, routing = self._decode_costs(flight, decodes)[0]
        num_tokens = len(_attempt_tokens(flight))
        best = self._prefill_costs(flight, prefills)[0][1] if prefills else None
        adapter_tokens = routing.adapter.tokens(self._transfer_cost.token_s) \
            if routing.adapter is not None else 0.0
        return prefill_location(self.config.max_local_prefill_length, num_tokens, decode, best,
                                decode.blocks_for(num_tokens),
                                self._transfer_cost.tokens_per_block,
                                self.config.local_prefill_stall_weight, routing.hit.cached,
                                adapter_tokens, routing.hit.pool_blocks)

    def _decode_costs(self, flight: Flight,
                      loads: list[WorkerLoad]) -> list[tuple[WorkerLoad, DecodeRouting]]:
        """``pairing.rank_decode`` of ``loads`` for the request, best first."""
        return rank_decode(loads, _attempt_tokens(flight), self.workers.kv_index, self._salt,
                           self.config.prefix_overlap_weight, adapter=_adapter_digest(flight),
                           token_s=self._transfer_cost.token_s)

    async def _place_on_decode(self, flight: Flight, place_on):
        """Place ``flight`` on a decode worker in ``rank_decode``'s order (``place_on``: reserve
        its blocks, or submit its prompt to compute there)."""
        def keep(routing: DecodeRouting) -> None:
            flight.decode_routing = routing

        return await self._place_ranked(flight, "decode", self._decode_costs, place_on, keep)

    async def _place_ranked(self, flight: Flight, role: str, costs, place_on, keep):
        """Place ``flight`` on a worker of ``role`` in the order ``costs(flight, loads)`` ranks
        them; ``keep`` gets the routing of the worker that took it."""
        routings: dict = {}

        def rank(loads: list[WorkerLoad]) -> list[WorkerLoad]:
            ranked = costs(flight, loads) if loads else []
            routings.update((w.stats.worker_id, r) for w, r in ranked)
            return [w for w, _ in ranked]

        async def on(flight: Flight, load: WorkerLoad):
            keep(routings[load.stats.worker_id])
            taken = await place_on(flight, load)
            if flight.timeline is not None:
                flight.timeline.placed(flight.decode_id, flight.decode_routing,
                                       flight.prefill_location, taken)
            return taken

        return await self._placer.place(flight, role, on, rank)

    async def _reserve(self, flight: Flight) -> Reservation:
        return await self._place_on_decode(flight, self._reserve_on)

    async def _reserve_on(self, flight: Flight, load: WorkerLoad) -> Reservation:
        handle = self.workers.handles[load.stats.worker_id]
        at = time.time()  # stats taken after the call began may count it
        reservation = await flight.bounded(lambda: handle.reserve(flight.request),
                                          self.config.rpc_timeout_s, "reserve")
        load.sent(blocks=reservation.num_blocks, at=at, adapter=_adapter_digest(flight))
        return reservation

    async def _submit(self, flight: Flight, load: WorkerLoad) -> None:
        handle = self.workers.handles[load.stats.worker_id]
        at = time.time()
        await flight.bounded(lambda: handle.submit(flight.request),
                            self.config.rpc_timeout_s, "submit")
        flight.prompt_sent = (load, load.sent(
            blocks=load.blocks_for(len(_attempt_tokens(flight))),
            tokens=self._uncached_tokens(flight, load), at=at, adapter=_adapter_digest(flight)))

    async def _prefill(self, flight: Flight, reservation: Reservation) -> PrefillResult:
        load = await self._pick_prefill(flight)
        worker_id = load.stats.worker_id
        handle = self.workers.handles[worker_id]
        if flight.timeline is not None:
            flight.timeline.prefill_sent(worker_id, flight.prefill_routing)
        renewing = asyncio.create_task(self._renew_lease(flight, reservation))
        try:
            result = await flight.bounded(lambda: handle.prefill(flight.request, reservation),
                                          self.config.prefill_timeout_s, "prefill")
        except (AttemptFailed, DeadlineExceededError):
            raise
        except RequestFaultError as exc:  # the request's own fault: it would fail anywhere
            raise RequestFailedError(f"{flight.name} on {worker_id}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the prefill moves the request
            self.workers.suspect(worker_id, f"prefill failed: {exc}")
            raise AttemptFailed("worker_failed", f"prefill on {worker_id} failed: "
                                f"{exc}") from exc
        finally:
            renewing.cancel()
        _prompt_computed(flight)
        if flight.timeline is not None:
            flight.timeline.prefilled(result)
        self.metrics.observe_prefill(worker_id, result)
        return result

    async def _pick_prefill(self, flight: Flight) -> WorkerLoad:
        started = time.monotonic()
        while not (loads := self.workers.live("prefill")):
            if time.monotonic() - started > self.config.worker_wait_s:
                raise AttemptFailed("worker_lost", "no prefill workers")
            await self._placer.wait_for_room(flight)
        load, flight.prefill_routing = self._rank_prefill(flight, loads)[0]
        flight.prefill_id = load.stats.worker_id
        flight.prompt_sent = (load, load.sent(tokens=self._uncached_tokens(flight, load),
                                              adapter=_adapter_digest(flight)))
        return load

    def _rank_prefill(self, flight: Flight,
                      loads: list[WorkerLoad]) -> list[tuple[WorkerLoad, PrefillRouting]]:
        """The workers that would prefill the request (its prompt and any output it carries
        when it moves), in the order ``prefill_routing`` tries them: lowest cost first, or in
        turn (round-robin: no runner-up was weighed, so the routings name none)."""
        ranked = self._prefill_costs(flight, loads)
        if self.config.prefill_routing == "round-robin":
            ranked = sorted(((w, dataclasses.replace(r, runner_up=None, runner_up_cost=None))
                             for w, r in ranked), key=lambda wr: wr[0].stats.worker_id)
            turn = next(self._prefill_turns) % len(ranked)
            ranked = ranked[turn:] + ranked[:turn]
        return ranked

    def _prefill_costs(self, flight: Flight,
                       loads: list[WorkerLoad]) -> list[tuple[WorkerLoad, PrefillRouting]]:
        """``pairing.rank_prefill`` of ``loads`` for the request, lowest cost first."""
        return rank_prefill(loads, _attempt_tokens(flight), loads[0].block_size,
                            self.workers.kv_index, self._salt,
                            self.config.prefix_overlap_weight,
                            self.config.prefill_kv_usage_weight,
                            adapter=_adapter_digest(flight), token_s=self._transfer_cost.token_s)

    @staticmethod
    def _uncached_tokens(flight: Flight, load: WorkerLoad) -> int:
        """The prompt tokens ``load`` has to compute for ``flight`` (its routing's hit off)."""
        hit = flight.prefill_routing.hit_blocks if flight.prefill_routing else 0
        return len(_attempt_tokens(flight)) - hit * load.block_size

    async def _renew_lease(self, flight: Flight, reservation: Reservation) -> None:
        """Keep the reservation alive while the prefill call is pending (see module doc)."""
        period = max(0.05, (reservation.lease_deadline - time.time()) / 3)
        handle = self.workers.handles.get(reservation.worker_id)
        while handle is not None:
            await asyncio.sleep(period)
            try:
                renewed = await asyncio.wait_for(handle.renew(flight.request_id),
                                                 self.config.rpc_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a dead decode worker fails the attempt
                logger.info("%s: lease renewal failed: %s", flight.name, exc)
                continue
            if renewed is None:  # committed or already failed: nothing left to renew
                return

    # -- streaming ----------------------------------------------------------------------------
    async def _drain(self, flight: Flight, num_finished: int = 0) -> AsyncIterator[RequestDelta]:
        """The attempt's deltas until every sequence of the request (``n``/``best_of``) has
        finished, ``num_finished`` of them already."""
        limit = self.config.stream_timeout_s
        num_seqs = flight.request.params.num_sequences
        while True:
            item = await flight.bounded(flight.queue.get, limit,
                                       f"waiting for {flight.decode_id}'s next token")
            if isinstance(item, Exception):
                raise item
            if item.preempted:
                raise AttemptFailed("preempted", f"{flight.decode_id}: {item.error}")
            if item.deadline_exceeded:
                raise DeadlineExceededError(f"{flight.decode_id}: {item.error}")
            if item.faulted:
                raise RequestFailedError(f"{flight.name} on {flight.decode_id}: "
                                         f"{item.error}")
            if item.error is not None:
                raise AttemptFailed("worker_failed", f"{flight.decode_id}: {item.error}")
            if item.new_token_ids:
                _prompt_computed(flight)
            yield item
            num_finished += item.finish_reason is not None
            if num_finished == num_seqs:
                return

    def _route(self, handle: WorkerHandle, delta: RequestDelta) -> None:
        flight = self._flights.get(delta.request_id)
        if flight is None:  # a forked sequence's (n > 1) is under its request's work id
            flight = self._flights.get(split_choice(delta.request_id)[0])
        if flight is None:
            if delta.finish_reason is None:  # a request no router follows: free it
                self._abort_orphan(handle.worker_id, delta.request_id)
        elif flight.decode_id == handle.worker_id and delta.attempt == flight.attempt:
            flight.queue.put_nowait(delta)

    def _abort_orphan(self, worker_id: str, request_id: str) -> None:
        if request_id in self._orphans:
            return
        self._orphans[request_id] = None
        while len(self._orphans) > 4096:
            self._orphans.popitem(last=False)
        logger.info("aborting %s on %s: no request of this router", request_id, worker_id)
        self.workers.abort_later(worker_id, request_id)

    def _fail_attempts_on(self, worker_id: str, why: str) -> None:
        """The worker was lost: every attempt streaming from it fails (and moves)."""
        for flight in self._flights.values():
            if flight.decode_id == worker_id and flight.phase in (Phase.PREFILLING,
                                                                  Phase.DECODING):
                flight.queue.put_nowait(AttemptFailed("worker_lost",
                                                      f"worker {worker_id} lost: {why}"))


def _attempt_tokens(flight: Flight) -> list[int]:
    """The tokens an attempt prefills: the prompt, then the outputs already streamed."""
    return flight.request.prompt_token_ids + flight.request.output_token_ids


def _failure_kind(flight: Flight, failure: AttemptFailed) -> str:
    """What a failed attempt leads to, as traces name it: a bounce (a full decode worker
    handed it back), a retry (no token streamed yet) or a migration."""
    if failure.reason == "preempted":
        return "bounce"
    return "migration" if flight.output_ids else "retry"


def _adapter_digest(flight: Flight) -> str | None:
    """The digest of the request's LoRA adapter (None: the base model)."""
    adapter = flight.request.adapter
    return None if adapter is None else adapter.digest


def _prompt_computed(flight: Flight) -> None:
    """The current attempt's prompt is computed: its worker's load no longer counts it queued
    (until the next stats, which count it right, the router would think it still is)."""
    if flight.prompt_sent is not None:
        load, entry = flight.prompt_sent
        load.computed(entry)
        flight.prompt_sent = None
