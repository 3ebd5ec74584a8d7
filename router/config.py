"""The router's limits and timeouts; ``pdserve serve`` generates a flag from every field."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.otel import check_endpoint

PREFILL_ROUTINGS = ("prefix", "round-robin")  # RouterConfig.prefill_routing
DISAGGREGATION_MODES = ("always", "auto", "never")  # RouterConfig.disaggregation


@dataclass(frozen=True)
class RouterConfig:
    """The router's limits and timeouts (``pdserve serve`` has a flag for each)."""

    max_requests_in_flight: int = 1024  # admitted and unfinished, at most
    max_tokens_in_flight: int = 1 << 20  # prompt tokens of admitted requests, at most
    reserve_wait_s: float | None = None  # longest wait for decode room (None: the deadline)
    max_attempts: int = 3  # reserve+prefill attempts before token 0 is streamed
    migration_limit: int = 3  # moves of one request to a new worker after token 0 (0 = off)
    max_bounces: int = 16  # times one request may be handed back for lack of KV room before
    # it fails (RESOURCE_EXHAUSTED, retry later): a request never bounces forever
    rpc_timeout_s: float = 10.0  # reserve / submit / abort / renew calls on a worker, at most
    prefill_timeout_s: float = 600.0  # one prefill call (queue + compute + send), at most
    stream_timeout_s: float = 120.0  # longest silence of a decoding request before it moves
    worker_wait_s: float = 30.0  # how long a request waits for ready workers (start-up, a pool
    # being replaced) before it fails UNAVAILABLE; its deadline may end the wait sooner
    poll_timeout_s: float = 0.05  # long-poll wait of each decode worker poller
    stats_interval_s: float = 0.25  # worker stats refresh period
    prefill_routing: str = "prefix"  # prefix: the prefill worker with the least queued work
    # after the prompt blocks the KV index says it holds; round-robin: each in turn
    prefix_overlap_weight: float = 1.0  # prefix routing: a prompt token the KV index says a
    # prefill worker holds counts as this many queued prompt tokens less (0: queues alone)
    prefill_kv_usage_weight: float = 0.0  # prefix routing: a prefill worker's share of KV
    # blocks in use, times this, counts as that many queued prompt tokens more
    disaggregation: str = "auto"  # with prefill and decode pools, where a prompt is
    # computed: always on a prefill worker; auto: on the decode worker itself when that is
    # sooner (the prefill queue and the KV transfer against the decode worker's queue) and
    # the prompt is short; never: always there
    max_local_prefill_length: int = 1024  # auto: longest prompt (tokens to compute) a decode
    # worker prefills itself, which bounds the stall it adds to that worker's decode steps
    local_prefill_stall_weight: float = 1.0  # auto: a local prefill's tokens count this many
    # times more per request decoding on that worker (each one's next token waits for them);
    # 0: the request's own first token alone decides
    scheduling_policy: str = "fcfs"  # fcfs | priority: order of the waiting queue
    priority_aging_s: float = 10.0  # a waiting request gains one priority level per this long
    max_request_kv_fraction: float = 1.0  # most of a decode worker's KV one request may hold
    grammar_check_timeout_s: float = 2.0  # a structured output's compile in the router, at
    # most; a constraint that takes longer is refused as too complex
    otlp_traces_endpoint: str | None = None  # an OTLP collector to send each request's
    # OpenTelemetry trace to (grpc: http://host:4317; http/protobuf: http://host:4318/v1/traces,
    # with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    # OTEL_EXPORTER_OTLP_ENDPOINT, else no traces (docs/observability.md)

    def __post_init__(self) -> None:
        if self.prefill_routing not in PREFILL_ROUTINGS:
            raise ValueError(f"prefill_routing must be one of {', '.join(PREFILL_ROUTINGS)}, "
                             f"got {self.prefill_routing!r}")
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation must be one of {', '.join(DISAGGREGATION_MODES)}, "
                             f"got {self.disaggregation!r}")
        if self.max_local_prefill_length < 0:
            raise ValueError(f"max_local_prefill_length must be >= 0, "
                             f"got {self.max_local_prefill_length}")
        for name in ("max_requests_in_flight", "max_tokens_in_flight", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("migration_limit", "max_bounces"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("prefix_overlap_weight", "prefill_kv_usage_weight",
                     "local_prefill_stall_weight"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        for name in ("rpc_timeout_s", "prefill_timeout_s", "stream_timeout_s", "worker_wait_s",
                     "poll_timeout_s", "stats_interval_s", "grammar_check_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, "
                             f"got {self.scheduling_policy!r}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if not 0 < self.max_request_kv_fraction <= 1:
            raise ValueError(f"max_request_kv_fraction must be in (0, 1], "
                             f"got {self.max_request_kv_fraction}")
        if self.otlp_traces_endpoint is not None:
            check_endpoint("otlp_traces_endpoint", self.otlp_traces_endpoint)
        if self.reserve_wait_s is not None and not self.reserve_wait_s > 0:
            raise ValueError(f"reserve_wait_s must be > 0 or None, got {self.reserve_wait_s}")
