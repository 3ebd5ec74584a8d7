"""The OpenTelemetry side of request traces (docs/observability.md): the SDK's tracer and OTLP
exporter, and the spans of one finished request built from its
:class:`~pdserve.router.otel.RequestTimeline`. ``router.otel.build_tracing`` imports this
module only when tracing is on.

Export never holds a request up: a finished request's spans go into a bounded queue
(:class:`BoundedSpanProcessor` in front of the SDK's ``BatchSpanProcessor``, whose thread
exports them); when the queue is full a span is dropped, and a batch the collector refused or
never answered (the exporter's own timeout) is dropped too. Both are counted in
``pdserve_otel_spans_dropped_total{reason}`` (``queue_full``, ``export_failed``), and a failing
export is logged at most once a minute.

The spans of one request (parents by indentation), each with explicit start and end times:

    POST /v1/completions | pdserve.v1.Generation/Generate   (SERVER; the caller's trace)
      prepare               door -> admitted: validation, tokenizing, the grammar check
      admission             admitted -> the first attempt's turn to place (waits for
                            workers and for its turn in the admission queue)
      placement             per attempt: its turn -> a worker took it (routing as attributes)
      decode reservation    per remote prefill: blocks reserved -> the KV committed
      prefill               the prefill call (or the streaming worker's own prefill)
        prefill queue       the worker's queue time
        prefill compute     first chunk -> token 0
        kv transfer         token 0 -> the last frame sent (remote prefill)
        kv send             per group of layers: packed and queued -> sent (remote prefill;
                            overlaps the compute of later layers and the kv transfer)
      decode                first token -> the attempt's end; events: first_token, tokens
                            (batches), and retry / migration / bounce with the attempt
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.router.metrics import RouterMetrics
from pdserve.router.otel import AttemptTimes, RequestTimeline, TracingSettings

logger = logging.getLogger(__name__)

FAILURE_LOG_INTERVAL_S = 60.0  # a failing export is logged at most this often
SHUTDOWN_TIMEOUT_S = 2.0  # the router's stop waits this long for the last spans, at most
_PROPAGATOR = TraceContextTextMapPropagator()


class CountingExporter(SpanExporter):
    """An exporter that counts what it could not deliver (``export_failed``) and logs a
    failure at most once a minute; it also tells the processor in front how many spans left
    the queue."""

    def __init__(self, inner: SpanExporter, metrics: RouterMetrics,
                 on_exported: Callable[[int], None]) -> None:
        self.inner, self.metrics, self.on_exported = inner, metrics, on_exported
        self._logged_at = -FAILURE_LOG_INTERVAL_S

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # noqa: BLE001 - a broken collector never reaches a request
            result, why = SpanExportResult.FAILURE, repr(exc)
        else:
            why = "the collector refused it or did not answer"
        finally:
            self.on_exported(len(spans))
        if result is not SpanExportResult.SUCCESS:
            self.metrics.otel_spans_dropped.labels("export_failed").inc(len(spans))
            now = time.monotonic()
            if now - self._logged_at >= FAILURE_LOG_INTERVAL_S:
                self._logged_at = now
                logger.warning("OpenTelemetry export of %d spans failed (%s); spans are "
                               "dropped and counted in pdserve_otel_spans_dropped_total until "
                               "it works (logged at most once a minute)", len(spans), why)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class BoundedSpanProcessor(SpanProcessor):
    """The SDK's BatchSpanProcessor behind a count of the spans it holds: past
    ``max_queue_size`` a span is dropped here, counted (``queue_full``), so the batch
    processor's own queue (as large) never overflows unseen."""

    def __init__(self, exporter: SpanExporter, metrics: RouterMetrics,
                 max_queue_size: int) -> None:
        self.metrics, self.max_queue_size = metrics, max_queue_size
        self._lock = threading.Lock()
        self._held = 0  # spans handed to the batch processor and not yet exported
        counting = CountingExporter(exporter, metrics, self._exported)
        self.batch = BatchSpanProcessor(counting, max_queue_size=max_queue_size,
                                        max_export_batch_size=min(512, max_queue_size))

    def _exported(self, count: int) -> None:
        with self._lock:
            self._held -= count

    def on_start(self, span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            full = self._held >= self.max_queue_size
            if not full:
                self._held += 1
        if full:
            self.metrics.otel_spans_dropped.labels("queue_full").inc()
            return
        self.batch.on_end(span)

    def shutdown(self) -> None:
        self.batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)


def otlp_exporter(settings: TracingSettings) -> SpanExporter:
    """The OTLP span exporter for ``settings`` (gRPC, plain text for an http:// endpoint)."""
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # lazy: the
            OTLPSpanExporter,  # protocol in use is the only exporter loaded
        )
        return OTLPSpanExporter(endpoint=settings.endpoint,
                                insecure=settings.endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # lazy: as above
        OTLPSpanExporter as HttpSpanExporter,
    )
    return HttpSpanExporter(endpoint=settings.endpoint)


class OtlpTracing:
    """The router's tracer: a TracerProvider of its own (the process's global one is left
    alone) whose spans go to ``exporter`` (the OTLP one of ``settings`` by default)."""

    def __init__(self, settings: TracingSettings, metrics: RouterMetrics,
                 exporter: SpanExporter | None = None) -> None:
        self.settings = settings
        self.processor = BoundedSpanProcessor(exporter or otlp_exporter(settings), metrics,
                                              settings.max_queue_size)
        self.provider = TracerProvider(resource=Resource.create(
            {"service.name": settings.service_name}))
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("pdserve.router")

    def finish(self, timeline: RequestTimeline, error: BaseException | None,
               num_output_tokens: int, finish_reason: str | None) -> None:
        """Make the request's spans (``error``: why it ended early, None: it finished); a
        failure here is logged, never the request's."""
        try:
            _RequestSpans(self.tracer, timeline, time.monotonic()).emit(
                error, num_output_tokens, finish_reason)
        except Exception:  # noqa: BLE001 - a trace is never worth a request
            logger.exception("making the spans of request %s failed", timeline.uid)

    def force_flush(self) -> bool:
        return self.provider.force_flush()

    def shutdown(self) -> None:
        """Export what is queued, waiting at most ``SHUTDOWN_TIMEOUT_S`` (a dead collector
        never holds the router's stop longer)."""
        done = threading.Thread(target=self.provider.shutdown, daemon=True,
                                name="pdserve-otel-shutdown")
        done.start()
        done.join(SHUTDOWN_TIMEOUT_S)


class _RequestSpans:
    """The spans of one finished request (see the module docstring)."""

    def __init__(self, tracer: trace.Tracer, timeline: RequestTimeline, ended_at: float):
        self.tracer, self.timeline, self.ended_at = tracer, timeline, ended_at

    def emit(self, error: BaseException | None, num_output_tokens: int,
             finish_reason: str | None) -> None:
        tl, origin = self.timeline, self.timeline.origin
        received = origin.received_at if origin is not None else tl.admitted_at or self.ended_at
        root = self.tracer.start_span(
            _root_name(tl), context=_caller_context(tl), kind=SpanKind.SERVER,
            start_time=tl.wall_ns(received), attributes=self._root_attributes(
                num_output_tokens, finish_reason))
        parent = trace.set_span_in_context(root)
        admitted = tl.admitted_at or self.ended_at
        if origin is not None:
            self._span(parent, "prepare", received, admitted, {})
        first = tl.attempts[0] if tl.attempts else None
        turn = None if first is None else first.turn_at  # admission ends at the first turn
        self._span(parent, "admission", admitted, turn or self.ended_at, {},
                   error if turn is None else None)
        for times in tl.attempts:
            last = times is tl.attempts[-1]
            _AttemptSpans(self, parent, times, times.ended_at or self.ended_at).emit(
                error if last else None)
        if error is not None:
            _set_error(root, error)
        root.end(end_time=tl.wall_ns(self.ended_at))

    def _root_attributes(self, num_output_tokens: int, finish_reason: str | None) -> dict:
        tl, origin = self.timeline, self.timeline.origin
        attributes = {"gen_ai.operation.name": "text_completion",
                      "gen_ai.request.model": tl.model,
                      "gen_ai.request.max_tokens": tl.max_tokens,
                      "gen_ai.request.temperature": tl.temperature,
                      "gen_ai.usage.input_tokens": tl.num_prompt_tokens,
                      "gen_ai.usage.output_tokens": num_output_tokens,
                      "pdserve.request.id": tl.uid, "pdserve.attempts": len(tl.attempts)}
        if origin is not None and origin.door == "http":
            attributes.update({"http.request.method": "POST", "http.route": origin.route})
        elif origin is not None:
            service, _, method = origin.route.strip("/").partition("/")
            attributes.update({"rpc.system": "grpc", "rpc.service": service,
                               "rpc.method": method})
        if finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = (finish_reason,)
        for kind, name in (("retry", "pdserve.retries"), ("migration", "pdserve.migrations"),
                           ("bounce", "pdserve.bounces")):
            count = sum(1 for a in tl.attempts if a.failure and a.failure[0] == kind)
            if count:
                attributes[name] = count
        return attributes

    def _span(self, parent: Context, name: str, start: float, end: float, attributes: dict,
              error: BaseException | str | None = None, events=()) -> Span:
        tl = self.timeline
        span = self.tracer.start_span(name, context=parent, start_time=tl.wall_ns(start),
                                      attributes=attributes)
        for event, at, event_attributes in events:
            span.add_event(event, event_attributes, timestamp=tl.wall_ns(at))
        if error is not None:
            _set_error(span, error)
        span.end(end_time=tl.wall_ns(max(start, end)))
        return span


class _AttemptSpans:
    """One attempt's spans: placement, decode reservation, prefill (and its parts), decode."""

    def __init__(self, spans: _RequestSpans, parent: Context, times: AttemptTimes,
                 ended_at: float) -> None:
        self.spans, self.parent, self.times, self.ended_at = spans, parent, times, ended_at
        self.base = {"pdserve.attempt": times.number}

    def emit(self, request_error: BaseException | None) -> None:
        t = self.times
        # what failed: the attempt's own failure, else (its last) the request's early end
        error: BaseException | str | None = request_error
        events = []
        if t.failure is not None:
            kind, reason, why = t.failure
            error = f"{kind} ({reason}): {why}"
            events = [(f"pdserve.{kind}", t.ended_at or self.ended_at,
                       {**self.base, "pdserve.failure.reason": reason,
                        "pdserve.failure.message": why})]
        placed = t.placed_at
        # the first attempt's wait for its turn is the admission span's; a later one's, its own
        start = t.turn_at if t.number == self.spans.timeline.attempts[0].number else t.started
        if start is None:  # it never had its turn: admission says why
            return
        self.spans._span(self.parent, "placement", start, placed or self.ended_at,
                         self._placement_attributes(), error if placed is None else None,
                         events if placed is None else ())
        if placed is None:
            return
        remote = t.reservation is not None
        prefilled = t.prefill_done_at
        if remote:
            self._reservation(prefilled, error if prefilled is None else None)
        if remote and t.prefill_sent_at is not None:
            self._remote_prefill(error if prefilled is None else None,
                                 events if prefilled is None else ())
            if prefilled is None:
                return
        elif t.local_prefill is not None and t.first_token_at is not None:
            self._local_prefill()
        if t.first_token_at is not None:
            self._decode(error, events)
        elif not remote:  # placed, then failed or ended before any token
            self.spans._span(self.parent, "decode", placed, self.ended_at,
                             self._worker_attributes(), error, events)

    def _placement_attributes(self) -> dict:
        t, attributes = self.times, dict(self.base)
        if t.decode_id is not None:
            attributes["pdserve.worker.id"] = t.decode_id
        routing = t.decode_routing
        if routing is not None:
            attributes.update({"pdserve.routing.room": routing.room,
                               "pdserve.routing.hit_blocks": routing.hit_blocks})
            if routing.runner_up is not None:
                attributes["pdserve.routing.runner_up"] = routing.runner_up
        elif t.prefill_routing is not None and t.reservation is None:  # colocated
            attributes.update(_prefill_routing_attributes(t))
        location = t.prefill_location
        if location is not None:
            attributes["pdserve.prefill.location"] = location.location
            for name in ("local_cost", "remote_cost"):
                if getattr(location, name) is not None:
                    attributes[f"pdserve.prefill.{name}"] = getattr(location, name)
        return attributes

    def _worker_attributes(self) -> dict:
        t = self.times
        role = "colocated" if t.prefill_location is None and t.reservation is None else "decode"
        return {**self.base, "pdserve.worker.id": t.decode_id or "", "pdserve.worker.role": role}

    def _reservation(self, prefilled: float | None, error) -> None:
        t, reservation = self.times, self.times.reservation
        attributes = {**self._worker_attributes(), "pdserve.kv.blocks": reservation.num_blocks,
                      "pdserve.kv.cached_blocks": reservation.num_cached_blocks}
        self.spans._span(self.parent, "decode reservation", t.placed_at,
                         prefilled or self.ended_at, attributes, error)

    def _remote_prefill(self, error, events) -> None:
        t, result = self.times, self.times.prefill
        attributes = {**self.base, "pdserve.worker.id": t.prefill_id or "",
                      "pdserve.worker.role": "prefill", **_prefill_routing_attributes(t)}
        end = t.prefill_done_at or self.ended_at
        if result is not None:
            attributes.update({"pdserve.prefill.cached_tokens": result.num_cached_tokens,
                               "pdserve.kv.transfer_bytes": result.transfer_bytes})
        span = self.spans._span(self.parent, "prefill", t.prefill_sent_at, end, attributes,
                                error, events)
        if result is None:
            return
        inner = trace.set_span_in_context(span)
        worker = {**self.base, "pdserve.worker.id": t.prefill_id or ""}
        transfer_start = end - result.transfer_time_s
        compute_start = transfer_start - result.prefill_time_s
        queue_start = max(t.prefill_sent_at, compute_start - result.queue_time_s)
        self.spans._span(inner, "prefill queue", queue_start, compute_start, worker)
        self.spans._span(inner, "prefill compute", compute_start, transfer_start, worker)
        self.spans._span(inner, "kv transfer", transfer_start, end,
                         {**worker, "pdserve.kv.transfer_bytes": result.transfer_bytes,
                          "pdserve.decode.worker.id": t.decode_id or ""})
        for send in result.kv_sends:
            self.spans._span(inner, "kv send", min(end, compute_start + send.queued_s),
                             min(end, compute_start + send.sent_s),
                             {**worker, "pdserve.kv.layers": f"{send.first_layer}-"
                                                             f"{send.end_layer - 1}",
                              "pdserve.kv.send_bytes": send.num_bytes})

    def _local_prefill(self) -> None:
        """The prompt the streaming (colocated, or decode) worker computed itself, laid back
        from its first token's arrival."""
        t = self.times
        queue_s, prefill_s = t.local_prefill
        end = t.first_token_at
        compute_start = end - prefill_s
        queue_start = max(t.placed_at, compute_start - queue_s)
        attributes = {**self._worker_attributes(), **_prefill_routing_attributes(t)}
        span = self.spans._span(self.parent, "prefill", queue_start, end, attributes)
        inner = trace.set_span_in_context(span)
        worker = {**self.base, "pdserve.worker.id": t.decode_id or ""}
        self.spans._span(inner, "prefill queue", queue_start, compute_start, worker)
        self.spans._span(inner, "prefill compute", compute_start, end, worker)

    def _decode(self, error, failure_events) -> None:
        t = self.times
        events = [("first_token", t.first_token_at, dict(self.base))]
        events += [("tokens", at, {"pdserve.tokens": n}) for at, n in t.batches]
        attributes = {**self._worker_attributes(), "pdserve.tokens": t.num_tokens}
        self.spans._span(self.parent, "decode", t.first_token_at, self.ended_at, attributes,
                         error, [*events, *failure_events])


def _prefill_routing_attributes(t: AttemptTimes) -> dict:
    attributes = {}
    routing = t.prefill_routing
    if routing is not None:
        attributes.update({"pdserve.routing.cost": routing.cost,
                           "pdserve.routing.hit_blocks": routing.hit_blocks})
        if routing.runner_up is not None:
            attributes["pdserve.routing.runner_up"] = routing.runner_up
    source = t.prefix_source
    if source is not None:
        attributes.update({"pdserve.prefix.pool_tokens": source.pool_tokens,
                           "pdserve.prefix.host_tokens": source.host_tokens,
                           "pdserve.prefix.disk_tokens": source.disk_tokens,
                           "pdserve.prefix.load_s": source.load_s})
    return attributes


def _root_name(timeline: RequestTimeline) -> str:
    origin = timeline.origin
    if origin is None:
        return "pdserve.generate"
    return f"POST {origin.route}" if origin.door == "http" else origin.route.strip("/")


def _caller_context(timeline: RequestTimeline) -> Context | None:
    """The caller's trace (W3C traceparent/tracestate) as the root's parent; a missing or
    malformed header starts a new trace."""
    origin = timeline.origin
    if origin is None or not origin.traceparent:
        return Context()
    carrier = {"traceparent": origin.traceparent}
    if origin.tracestate:
        carrier["tracestate"] = origin.tracestate
    return _PROPAGATOR.extract(carrier, context=Context())


def _set_error(span: Span, error: BaseException | str) -> None:
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        span.set_attribute("error.type", "cancelled")
        message = "cancelled: the client went away, or its door closed the stream early"
    elif isinstance(error, BaseException):
        message = str(error) or type(error).__name__
        span.set_attribute("error.type", type(error).__name__)
    else:
        message = error
    span.set_status(Status(StatusCode.ERROR, message))
