"""The router core: admission, pairing, a state machine per request, streaming, cancellation.

Per request (disaggregated mode), as ``Router.generate`` drives it:

1. ADMIT: bounded by requests and prompt tokens in flight (QueueFullError when full).
2. RESERVE: the best decode worker (``pairing.rank_decode``) reserves blocks under a lease;
   one without room is skipped; none with room within ``reserve_wait_s`` -> QueueFullError;
   a request no decode worker could ever hold -> RequestTooLargeError.
3. PREFILL: the best prefill worker (``pairing.pick_prefill``) computes the prompt, ships the
   KV into the reservation and returns token 0, streamed at once (TTFT). If the prefill fails
   before token 0, the reservation is aborted and the pair retried (``max_attempts``).
4. DECODE: the decode worker's deltas arrive through one poller per worker and are routed by
   request id into the request's queue; the stream ends with the delta carrying finish_reason.
5. END: normal finish, or ``abort`` (client cancel, deadline, server stop) which reaches both
   workers (idempotent); a dead worker fails its requests with NoWorkersError (UNAVAILABLE).

Colocated mode replaces 2-4 by ``submit`` to one worker and the same delta routing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pdserve.engine.messages import RequestDelta, WorkRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.backend import GenerationDelta, ModelSpec
from pdserve.router.directory import WorkerDirectory
from pdserve.router.errors import NoWorkersError, QueueFullError, RequestTooLargeError
from pdserve.router.handles import NoCapacity
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import WorkerLoad, pick_prefill, rank_decode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    max_requests_in_flight: int = 1024  # admitted and unfinished, at most
    max_tokens_in_flight: int = 1 << 20  # prompt tokens of admitted requests, at most
    reserve_wait_s: float | None = None  # wait for decode room at most this long (None: until
    # the request's deadline); a request that finds no room waits, it does not fail
    max_attempts: int = 3  # reserve+prefill attempts before token 0 is streamed
    migration_limit: int = 3  # moves of one request to a new worker after token 0 (0 = off)
    rpc_timeout_s: float = 10.0  # reserve / submit / abort / renew calls on a worker, at most
    prefill_timeout_s: float = 600.0  # one prefill call (queue + compute + send), at most
    stream_timeout_s: float = 120.0  # longest silence of a decoding request before it moves
    poll_timeout_s: float = 0.05  # long-poll wait of each decode worker poller
    stats_interval_s: float = 0.25  # worker stats refresh period
    prefix_memory_blocks: int = 8192  # prompt block hashes remembered per prefill worker


@dataclass
class RequestTrace:
    """Where one finished request's time went (seconds)."""

    request_id: str
    ttft: float
    e2e: float
    queue: float = 0.0  # waiting at the prefill (or colocated) worker
    prefill: float = 0.0
    transfer: float = 0.0
    decode: float = 0.0  # first token -> last token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None

    @property
    def tpot(self) -> float:
        return self.decode / max(1, self.num_output_tokens - 1)


@dataclass
class _Flight:
    """A request in flight."""

    request: WorkRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestDelta | Exception
    arrival: float = field(default_factory=time.monotonic)
    prefill_id: str | None = None
    decode_id: str | None = None  # the worker streaming deltas (decode or colocated)
    phase: str = "admitted"  # admitted | reserving | prefilling | decoding | done
    trace: RequestTrace | None = None
    last_token_at: float | None = None


class Router:
    """Implements the gRPC front door's GenerationBackend over worker handles."""

    def __init__(self, spec: ModelSpec, directory: WorkerDirectory,
                 tokenize: Callable[[str], list[int]], config: RouterConfig | None = None,
                 metrics: RouterMetrics | None = None):
        self.spec = spec
        self.directory = directory
        self._tokenize = tokenize
        self.config = config or RouterConfig()
        self.metrics = metrics or RouterMetrics()
        self._loads: dict[str, WorkerLoad] = {}
        self._handles: dict = {}
        self._pollers: dict[str, asyncio.Task] = {}
        self._flights: dict[str, _Flight] = {}
        self._tokens_in_flight = 0
        self._tasks: list[asyncio.Task] = []
        self.traces: deque[RequestTrace] = deque(maxlen=100_000)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._refresh_loop()))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._pollers.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._pollers.values(), return_exceptions=True)
        self._tasks.clear()
        self._pollers.clear()

    async def refresh(self) -> None:
        """Re-read membership and load; start pollers for new streaming workers."""
        snapshot = await self.directory.snapshot()
        seen = set()
        for handle, stats in snapshot:
            seen.add(stats.worker_id)
            self._handles[stats.worker_id] = handle
            load = self._loads.get(stats.worker_id)
            if load is None:
                self._loads[stats.worker_id] = WorkerLoad(stats)
            else:
                load.refresh(stats)
            self.metrics.set_worker(stats)
            if stats.role != "prefill" and stats.worker_id not in self._pollers:
                self._pollers[stats.worker_id] = asyncio.create_task(self._poll(handle))
        for worker_id in set(self._loads) - seen:
            self._worker_lost(worker_id, "left the registry")

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep routing on the last known view
                logger.exception("worker refresh failed")

    def _live(self, role: str) -> list[WorkerLoad]:
        return [w for w in self._loads.values() if w.stats.role == role and not w.stats.draining]

    @property
    def mode(self) -> str:
        return "colocated" if self._live("colocated") and not self._live("decode") \
            else "disaggregated"

    # -- GenerationBackend --------------------------------------------------------------------
    def is_ready(self) -> bool:
        return bool(self._live("colocated")) or bool(self._live("prefill") and self._live("decode"))

    def model_info(self) -> ModelSpec:
        return self.spec

    async def tokenize(self, text: str) -> list[int]:
        return await asyncio.to_thread(self._tokenize, text)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       deadline: float | None) -> AsyncIterator[GenerationDelta]:
        flight = self._admit(request_id, prompt_token_ids, params)
        finished = False
        try:
            run = self._colocated if self.mode == "colocated" else self._disaggregated
            async for delta in run(flight):
                self._observe(flight, delta)
                yield GenerationDelta(delta.new_token_ids, delta.text, delta.logprobs,
                                      delta.finish_reason)
                if delta.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                await self._abort_flight(flight)
            self._release(flight)

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        if flight is not None:
            await self._abort_flight(flight)

    # -- admission ----------------------------------------------------------------------------
    def _admit(self, request_id: str, prompt_token_ids: list[int],
               params: SamplingParams) -> _Flight:
        if not self.is_ready():
            raise NoWorkersError("no workers are ready to take requests")
        cfg, n = self.config, len(prompt_token_ids)
        if len(self._flights) >= cfg.max_requests_in_flight:
            raise QueueFullError(f"{len(self._flights)} requests in flight (the limit); retry")
        if self._tokens_in_flight + n > cfg.max_tokens_in_flight:
            raise QueueFullError(f"{self._tokens_in_flight} prompt tokens in flight; retry")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        flight = _Flight(WorkRequest(request_id, list(prompt_token_ids), params, seed,
                                     time.time()))
        self._flights[request_id] = flight
        self._tokens_in_flight += n
        self.metrics.router_running.labels("router").set(len(self._flights))
        return flight

    def _release(self, flight: _Flight) -> None:
        if self._flights.pop(flight.request.request_id, None) is not None:
            self._tokens_in_flight -= len(flight.request.prompt_token_ids)
        flight.phase = "done"
        self.metrics.router_running.labels("router").set(len(self._flights))

    async def _abort_flight(self, flight: _Flight) -> None:
        request_id = flight.request.request_id
        ids = {flight.prefill_id, flight.decode_id} - {None}
        await asyncio.gather(*(self._handles[w].abort(request_id) for w in ids
                               if w in self._handles), return_exceptions=True)

    # -- disaggregated ------------------------------------------------------------------------
    async def _disaggregated(self, flight: _Flight) -> AsyncIterator[RequestDelta]:
        for attempt in range(1, self.config.max_attempts + 1):
            reservation = await self._reserve(flight)
            prefill = self._pick_prefill(flight)
            flight.phase = "prefilling"
            try:
                result = await self._handles[prefill.stats.worker_id].prefill(
                    flight.request, reservation)
                break
            except Exception as exc:  # noqa: BLE001 - any failure before token 0 is retried
                await self._abort_flight(flight)
                logger.warning("%s: prefill on %s failed (attempt %d): %s",
                               flight.request.request_id, flight.prefill_id, attempt, exc)
                flight.queue = asyncio.Queue()  # drop what the aborted decode side sent
                if attempt == self.config.max_attempts:
                    raise NoWorkersError(f"prefill failed: {exc}") from exc
        self.metrics.observe_prefill(prefill.stats.worker_id, result)
        flight.trace = RequestTrace(flight.request.request_id, 0.0, 0.0, result.queue_time_s,
                                    result.prefill_time_s, result.transfer_time_s)
        flight.phase = "decoding"
        yield result.first
        if result.first.finish_reason is None:
            async for delta in self._drain(flight):
                yield delta
        else:
            await self._handles[flight.decode_id].abort(flight.request.request_id)

    async def _reserve(self, flight: _Flight):
        flight.phase = "reserving"
        deadline = time.monotonic() + self.config.reserve_wait_s
        too_large = 0
        while True:
            candidates = rank_decode(self._live("decode"))
            if not candidates:
                raise NoWorkersError("no decode workers")
            for load in candidates:
                try:
                    reservation = await self._handles[load.stats.worker_id].reserve(
                        flight.request)
                except NoCapacity:
                    continue
                except ValueError as exc:
                    too_large += 1
                    if too_large >= len(candidates):
                        raise RequestTooLargeError(str(exc)) from exc
                    continue
                load.pending_blocks += reservation.num_blocks
                flight.decode_id = load.stats.worker_id
                return reservation
            if time.monotonic() > deadline:
                raise QueueFullError("no decode worker has free KV blocks; retry later")
            await asyncio.sleep(self.config.stats_interval_s)

    def _pick_prefill(self, flight: _Flight) -> WorkerLoad:
        loads = self._live("prefill")
        if not loads:
            raise NoWorkersError("no prefill workers")
        block_size = int(loads[0].stats.ledger.get("block_size", 16))
        prompt = flight.request.prompt_token_ids
        load, hashes = pick_prefill(loads, prompt, block_size)
        load.pending_tokens += len(prompt)
        load.remember(hashes, self.config.prefix_memory_blocks)
        flight.prefill_id = load.stats.worker_id
        return load

    # -- colocated ----------------------------------------------------------------------------
    async def _colocated(self, flight: _Flight) -> AsyncIterator[RequestDelta]:
        loads = rank_decode(self._live("colocated"))
        if not loads:
            raise NoWorkersError("no colocated workers")
        load = loads[0]
        flight.decode_id = load.stats.worker_id
        try:
            await self._handles[flight.decode_id].submit(flight.request)
        except ValueError as exc:
            raise RequestTooLargeError(str(exc)) from exc
        load.pending_tokens += len(flight.request.prompt_token_ids)
        flight.phase = "decoding"
        async for delta in self._drain(flight):
            yield delta

    # -- streaming ----------------------------------------------------------------------------
    async def _drain(self, flight: _Flight) -> AsyncIterator[RequestDelta]:
        while True:
            item = await flight.queue.get()
            if isinstance(item, Exception):
                raise item
            if item.error is not None:
                raise NoWorkersError(f"{flight.decode_id}: {item.error}")
            yield item
            if item.finish_reason is not None:
                return

    async def _poll(self, handle) -> None:
        while True:
            try:
                deltas = await handle.poll(self.config.poll_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the worker is gone
                self._worker_lost(handle.worker_id, f"poll failed: {exc}")
                return
            for delta in deltas:
                flight = self._flights.get(delta.request_id)
                if flight is not None and flight.decode_id == handle.worker_id:
                    flight.queue.put_nowait(delta)

    def _worker_lost(self, worker_id: str, why: str) -> None:
        logger.warning("worker %s lost: %s", worker_id, why)
        self._loads.pop(worker_id, None)
        self._handles.pop(worker_id, None)
        poller = self._pollers.pop(worker_id, None)
        if poller is not None and poller is not asyncio.current_task():
            poller.cancel()
        for flight in self._flights.values():
            if flight.decode_id == worker_id and flight.phase == "decoding":
                flight.queue.put_nowait(NoWorkersError(f"worker {worker_id} lost: {why}"))

    def _observe(self, flight: _Flight, delta: RequestDelta) -> None:
        now, n = time.monotonic(), len(delta.new_token_ids)
        if flight.trace is None:
            flight.trace = RequestTrace(flight.request.request_id, 0.0, 0.0)
        trace = flight.trace
        if n and flight.last_token_at is None:
            trace.ttft = now - flight.arrival
            self.metrics.ttft.labels("router").observe(trace.ttft)
        elif n:
            gap = (now - flight.last_token_at) / n
            for _ in range(n):
                self.metrics.itl.labels("router").observe(gap)
        if n:
            flight.last_token_at = now
        trace.num_output_tokens = delta.num_output_tokens or trace.num_output_tokens + n
        if delta.finish_reason is not None:
            trace.e2e = now - flight.arrival
            trace.decode = trace.e2e - trace.ttft
            trace.num_prompt_tokens = len(flight.request.prompt_token_ids)
            trace.finish_reason = delta.finish_reason
            self.metrics.e2e.labels("router").observe(trace.e2e)
            self.traces.append(trace)
