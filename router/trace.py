"""Where each request's time went: the router's per-request trace and latency metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.router.flight import Flight
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import DecodeRouting, PrefillLocation, PrefillRouting
from pdserve.worker_api import PrefixSource, RequestDelta


@dataclass
class RequestTrace:
    """Where one finished request's time went (seconds)."""

    request_id: str  # the client's id for the request (its label), else the router's uid
    ttft: float
    e2e: float
    queue: float = 0.0  # waiting at the prefill (or colocated) worker
    prefill: float = 0.0
    transfer: float = 0.0
    decode: float = 0.0  # first token -> last token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    num_retries: int = 0  # failed attempts before the first token
    num_migrations: int = 0  # attempts moved to new workers after the first token
    prefill_routing: PrefillRouting | None = None  # how the worker that computed its prompt
    # was chosen (the first prefill worker, or the colocated worker)
    prefill_location: PrefillLocation | None = None  # disaggregated: where the prompt was
    # computed (a prefill worker, or the decode worker itself) and why
    decode_routing: DecodeRouting | None = None  # disaggregated: how the decode worker was
    # chosen (the first attempt's)
    decode_cached_blocks: int = 0  # the prompt's leading blocks the decode worker's prefix
    # cache held (its KV was not sent)
    prefix_source: PrefixSource | None = None  # where the worker that computed its prompt
    # found the leading tokens (its pool, its host or disk tier) and the loads' time
    decode_prefix_source: PrefixSource | None = None  # disaggregated: the decode worker's
    grammar_compile_s: float | None = None  # the router's compile of its structured output
    # (0 when cached; None: free output, or not checked)
    grammar_cache_hit: bool | None = None  # the router's check answered from its cache
    prefill_grammar_compile_s: float | None = None  # the prefill worker's compile of it
    prefill_grammar_cache_hit: bool | None = None  # (its grammar cache held it)
    decode_grammar_compile_s: float | None = None  # the decode worker's compile of it
    decode_grammar_cache_hit: bool | None = None  # (its grammar cache held it)
    adapter: str | None = None  # the served name of its LoRA adapter (None: the base model);
    # where the adapter was on each worker when placed: prefill_routing.adapter and
    # decode_routing.adapter (``pairing.AdapterCost``, from the stats the router placed by)

    @property
    def tpot(self) -> float:
        return self.decode / max(1, self.num_output_tokens - 1)

    @property
    def adapter_loaded(self) -> bool | None:
        """Whether a worker that ran the request had to put its LoRA adapter in a slot for it
        (the adapter was neither resident there nor sent there before, by the stats the router
        placed it by); None: the base model."""
        if self.adapter is None:
            return None
        costs = [r.adapter for r in (self.prefill_routing, self.decode_routing)
                 if r is not None and r.adapter is not None]
        return any(cost.loads for cost in costs)


def observe(flight: Flight, delta: RequestDelta, metrics: RouterMetrics,
            ends: bool) -> RequestTrace | None:
    """Account one streamed delta (TTFT, ITL, counts); returns the trace when it ``ends`` the
    request (its final delta; with ``n`` > 1, that of the last sequence to finish)."""
    now, n = time.monotonic(), len(delta.new_token_ids)
    if flight.trace is None:
        flight.trace = _colocated_trace(flight, delta, metrics)
    trace = flight.trace
    if n and flight.last_token_at is None:
        trace.ttft = now - flight.arrival
        metrics.observe_ttft(trace.ttft)
    elif n:
        metrics.observe_itl((now - flight.last_token_at) / n, n)
    if n:
        flight.last_token_at = now
    if flight.request.params.num_sequences == 1:
        trace.num_output_tokens = delta.num_output_tokens or trace.num_output_tokens + n
    else:  # (each delta counts its own sequence's: the request's are their sum)
        trace.num_output_tokens += n
    if not ends:
        return None
    trace.e2e = now - flight.arrival
    trace.decode = trace.e2e - trace.ttft
    trace.num_prompt_tokens = len(flight.request.prompt_token_ids)
    trace.adapter = None if flight.request.adapter is None else flight.request.adapter.name
    trace.finish_reason = delta.finish_reason
    trace.num_retries, trace.num_migrations = flight.num_retries, flight.num_migrations
    metrics.e2e.labels("router").observe(trace.e2e)
    return trace


def _colocated_trace(flight: Flight, delta: RequestDelta, metrics: RouterMetrics) -> RequestTrace:
    """The trace of a request no prefill worker returned: the first token of the colocated
    worker, or of the decode worker that prefilled it, says how long the request queued there
    and how long its prefill took."""
    trace = RequestTrace(flight.label or flight.uid, 0.0, 0.0,
                         prefill_routing=flight.prefill_routing,
                         prefill_location=flight.prefill_location,
                         decode_routing=flight.decode_routing)
    if delta.queue_time_s is not None and delta.prefill_time_s is not None:
        trace.queue, trace.prefill = delta.queue_time_s, delta.prefill_time_s
        trace.prefix_source = delta.prefix_source
        role = "colocated" if flight.prefill_location is None else "decode"
        labels = (role, flight.decode_id or "")
        metrics.queue.labels(*labels).observe(trace.queue)
        metrics.prefill.labels(*labels).observe(trace.prefill)
    return trace
