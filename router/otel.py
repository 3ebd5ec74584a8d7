"""OpenTelemetry traces of requests: what the router records while a request runs, and the
settings that turn tracing on (docs/observability.md).

Off (the default: no ``--otlp-traces-endpoint`` and no ``OTEL_EXPORTER_OTLP_*ENDPOINT``, or
``OTEL_SDK_DISABLED=true``) the router holds no tracer, the OpenTelemetry SDK is never
imported, and each hook in ``router.core`` is one ``is not None`` check of the flight's
``timeline``. On, ``router.otel_export`` (imported only then) builds the SDK's tracer and turns
each finished request's :class:`RequestTimeline` into spans.

Where each time comes from: the router stamps its own steps (admission, its turn to place,
the worker that took the request, the prefill call sent and answered, every delta, every
failed attempt) on ``time.monotonic()``; the workers' durations come back in the messages they
already return (``PrefillResult``: queue, compute and KV transfer; a colocated or local
prefill's first delta: queue and compute). One wall-clock anchor per request turns the
monotonic stamps into the spans' times. A worker's durations are laid back from the moment the
router got its answer (the call's own latency falls before the queue).

The front doors give each request a :class:`RequestOrigin`: which door and route, when it came
in, and the caller's W3C ``traceparent``/``tracestate`` (HTTP headers or gRPC metadata), which
become the request's root span's parent, so a caller's trace continues into pdserve.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from pdserve.router.metrics import RouterMetrics
from pdserve.router.pairing import DecodeRouting, PrefillLocation, PrefillRouting
from pdserve.worker_api import PrefillResult, PrefixSource, RequestDelta, Reservation

__all__ = ["OTLP_PROTOCOLS", "AttemptTimes", "RequestOrigin", "RequestTimeline",
           "RequestTracing", "TracingSettings", "build_tracing", "check_endpoint",
           "tracing_settings"]

OTLP_PROTOCOLS = ("grpc", "http/protobuf")  # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
DEFAULT_SERVICE_NAME = "pdserve"
MAX_TOKEN_EVENTS = 32  # token batches one decode span keeps as events (coalesced past it)
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context


def check_endpoint(name: str, url: str) -> None:
    """ValueError naming ``name`` unless ``url`` is an http(s) URL with a host."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ValueError(f"{name} must be an http:// or https:// URL with a host (an OTLP "
                         f"collector, such as http://localhost:4317), got {url!r}")


@dataclass(frozen=True)
class TracingSettings:
    """Where and how the router exports its spans."""

    endpoint: str  # the OTLP collector (gRPC: http://host:4317; HTTP: .../v1/traces)
    protocol: str = "grpc"  # grpc | http/protobuf
    service_name: str = DEFAULT_SERVICE_NAME  # the resource's service.name
    max_queue_size: int = 2048  # spans waiting for export, at most (more are dropped, counted)

    def __post_init__(self) -> None:
        check_endpoint("otlp_traces_endpoint", self.endpoint)
        if self.protocol not in OTLP_PROTOCOLS:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of "
                             f"{', '.join(OTLP_PROTOCOLS)}, got {self.protocol!r}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")


def tracing_settings(endpoint: str | None,
                     environ: Mapping[str, str]) -> TracingSettings | None:
    """The settings from the router's ``otlp_traces_endpoint`` and the standard OpenTelemetry
    environment; None when tracing is off. ``OTEL_SDK_DISABLED=true`` turns it off whatever
    else says; the endpoint is ``endpoint``, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (with ``/v1/traces`` added under http/protobuf, as the
    specification says of the generic one); the protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
    or ``OTEL_EXPORTER_OTLP_PROTOCOL`` (grpc by default); the service ``OTEL_SERVICE_NAME``;
    the queue ``OTEL_BSP_MAX_QUEUE_SIZE``."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    url = endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not url and environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        url = environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
        if protocol == "http/protobuf":
            url = url.rstrip("/") + "/v1/traces"
    if not url:
        return None
    queue = environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048")
    if not queue.strip().isdigit():
        raise ValueError(f"OTEL_BSP_MAX_QUEUE_SIZE must be a whole number, got {queue!r}")
    return TracingSettings(url.strip(), protocol,
                           environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME, int(queue))


@dataclass(frozen=True)
class RequestOrigin:
    """Where and when a request came in, as its front door saw it."""

    door: str  # "http" | "grpc"
    route: str  # "/v1/chat/completions", "/pdserve.v1.Generation/Generate", ...
    received_at: float  # time.monotonic() when the door took it (before validating it)
    traceparent: str | None = None  # the caller's W3C trace context (None: a new trace)
    tracestate: str | None = None

    @classmethod
    def of(cls, door: str, route: str, header: Callable[[str], str | None]) -> RequestOrigin:
        """The origin of a request arriving now, its trace headers read with ``header``
        (lower-case name -> value or None)."""
        return cls(door, route, time.monotonic(), header("traceparent"), header("tracestate"))


@dataclass
class AttemptTimes:
    """One attempt of a request as the router saw it (``time.monotonic()`` stamps)."""

    number: int  # WorkRequest.attempt
    started: float  # placing began
    turn_at: float | None = None  # its turn in the admission queue came
    placed_at: float | None = None  # a worker took it (blocks reserved, or prompt submitted)
    decode_id: str | None = None  # the decode (or colocated) worker
    decode_routing: DecodeRouting | None = None
    prefill_location: PrefillLocation | None = None  # disaggregated: where its prompt ran
    reservation: Reservation | None = None  # the decode worker's blocks (remote prefill)
    prefill_id: str | None = None  # the prefill worker (remote prefill)
    prefill_routing: PrefillRouting | None = None  # why that worker (or the colocated one)
    prefill_sent_at: float | None = None  # the prefill call went out
    prefill_done_at: float | None = None  # its result came back (KV committed)
    prefill: PrefillResult | None = None  # the prefill worker's durations
    local_prefill: tuple[float, float] | None = None  # a prompt the streaming worker
    # computed itself: (queue_time_s, prefill_time_s) of its first delta
    prefix_source: PrefixSource | None = None  # where its prompt's leading tokens were found
    first_token_at: float | None = None  # this attempt's first token reached the router
    batches: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens) per
    # delta after the first, coalesced to at most MAX_TOKEN_EVENTS
    num_tokens: int = 0  # tokens this attempt streamed
    ended_at: float | None = None  # it failed (the last attempt ends with the request)
    failure: tuple[str, str, str] | None = None  # (retry | migration | bounce, reason, why)


@dataclass
class RequestTimeline:
    """What the router records of one request for its trace (see the module docstring)."""

    origin: RequestOrigin | None  # None: a caller that is no front door (a benchmark)
    model: str  # the served model's name, or the request's LoRA adapter's
    num_prompt_tokens: int = 0
    max_tokens: int = 0  # the request's, as the router runs it
    temperature: float = 0.0
    anchor: tuple[float, int] = field(  # (time.monotonic(), time.time_ns()) taken together
        default_factory=lambda: (time.monotonic(), time.time_ns()))
    admitted_at: float | None = None  # the router admitted it
    uid: str = ""  # the router's id for it
    attempts: list[AttemptTimes] = field(default_factory=list)

    def wall_ns(self, t: float) -> int:
        """A ``time.monotonic()`` stamp as the wall clock's nanoseconds."""
        mono, wall = self.anchor
        return wall + int((t - mono) * 1e9)

    @property
    def current(self) -> AttemptTimes:
        return self.attempts[-1]

    def attempt(self, number: int) -> None:
        self.attempts.append(AttemptTimes(number, time.monotonic()))

    def turn(self) -> None:
        """The attempt's turn to place came (the first time: an outranked one queues again)."""
        if self.attempts and self.current.turn_at is None:
            self.current.turn_at = time.monotonic()

    def placed(self, decode_id: str | None, routing: DecodeRouting | None,
               location: PrefillLocation | None, taken: object) -> None:
        """A worker took the attempt: ``taken`` is the Reservation a decode worker made, or
        None (a prompt submitted to compute there)."""
        times = self.current
        times.placed_at, times.decode_id = time.monotonic(), decode_id
        times.decode_routing, times.prefill_location = routing, location
        if isinstance(taken, Reservation):
            times.reservation = taken

    def prefill_sent(self, worker_id: str, routing: PrefillRouting | None) -> None:
        times = self.current
        times.prefill_sent_at, times.prefill_id = time.monotonic(), worker_id
        times.prefill_routing = routing

    def prefilled(self, result: PrefillResult) -> None:
        times = self.current
        times.prefill_done_at, times.prefill = time.monotonic(), result
        times.prefix_source = result.prefix_source

    def delta(self, delta: RequestDelta, routing: PrefillRouting | None) -> None:
        """A delta of the current attempt reached the router (``routing``: the colocated
        worker's, for a prompt it computed itself)."""
        times, now = self.current, time.monotonic()
        n = len(delta.new_token_ids)
        if delta.queue_time_s is not None and delta.prefill_time_s is not None:
            times.local_prefill = (delta.queue_time_s, delta.prefill_time_s)
            times.prefix_source = delta.prefix_source
            times.prefill_routing = times.prefill_routing or routing
        if not n:
            return
        times.num_tokens += n
        if times.first_token_at is None:
            times.first_token_at = now
            return
        batches = times.batches
        batches.append((now, n))
        if len(batches) > MAX_TOKEN_EVENTS:  # halve: each pair becomes its later one
            times.batches = [(batches[i + 1][0], batches[i][1] + batches[i + 1][1])
                             for i in range(0, len(batches) - 1, 2)] + \
                            ([batches[-1]] if len(batches) % 2 else [])

    def failed(self, kind: str, reason: str, why: str) -> None:
        """The attempt failed; ``kind``: retry (before the first token), migration (after
        it) or bounce (a full decode worker handed it back)."""
        self.current.ended_at, self.current.failure = time.monotonic(), (kind, reason, why)


class RequestTracing(Protocol):
    """What the router asks of its tracer (``router.otel_export.OtlpTracing``)."""

    def finish(self, timeline: RequestTimeline, error: BaseException | None,
               num_output_tokens: int, finish_reason: str | None) -> None:
        """Make the finished request's spans (``error``: why it ended early; None: it
        finished); never blocks on the collector."""
        ...

    def shutdown(self) -> None:
        """Export what is queued, bounded in time."""
        ...


def build_tracing(endpoint: str | None, environ: Mapping[str, str],
                  metrics: RouterMetrics) -> RequestTracing | None:
    """The router's tracer for its ``otlp_traces_endpoint`` and the OpenTelemetry
    environment (:func:`tracing_settings`); None when tracing is off."""
    settings = tracing_settings(endpoint, environ)
    if settings is None:
        return None
    from pdserve.router import otel_export  # lazy: the OpenTelemetry SDK, only when traces are on
    return otel_export.OtlpTracing(settings, metrics)
