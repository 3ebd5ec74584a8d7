"""Prometheus metrics (prefix ``pdserve_``, label ``role``, and ``worker`` where per worker).

Latency histograms are observed by the router as requests flow; per-worker gauges and
counters are set from the worker stats the router refreshes, and removed
(:meth:`RouterMetrics.remove_worker`) when a worker leaves, so dashboards drop dead workers.
Fault counters: ``pdserve_request_migrations_total{reason}`` (the router core),
``pdserve_worker_restarts_total{role}`` (the pool manager, in the router's process) and
``pdserve_requests_failed_total{code}`` (the gRPC front door, by status code name).
Traces (``router.otel_export``): ``pdserve_otel_spans_dropped_total{reason}`` (spans never
delivered to the OTLP collector: ``queue_full``, ``export_failed``).
Pools (set by the pool manager's reconcile in the router's process):
``pdserve_pool_target_workers{role}``, ``pdserve_pool_workers{role,state}`` and
``pdserve_autoscaler_decisions_total{role,direction,reason}``.
Control plane (``pdserve.cluster.control_plane``): ``pdserve_control_plane_degraded`` (1
while Redis is unreachable), ``pdserve_malformed_records_total{family}``,
``pdserve_untrusted_records_total{kind}`` and ``pdserve_control_plane_repairs_total{family}``.

Structured output (the router's check of each request's constraint, ``router.constraints``):
``pdserve_structured_output_compiles_total`` (constraints it compiled),
``pdserve_structured_output_cache_hits_total`` (answered from its cache),
``pdserve_structured_output_compile_seconds`` and
``pdserve_structured_output_invalid_requests_total{reason}`` (``does_not_compile``,
``too_complex``).

LoRA adapters (docs/lora.md), per worker serving them, from its stats:
``pdserve_lora_slots``, ``pdserve_lora_resident_adapters`` (adapters in a slot),
``pdserve_lora_loads_total{source}`` (``disk``: adapters read from their files; ``host``: slot
loads that read no file, the worker's slot loads less its file reads) and
``pdserve_lora_evictions_total``; per adapter, counted by the router as it admits each request:
``pdserve_lora_requests_total{adapter}`` (by the adapter's served name; base-model requests are
not counted).

KV tiers below the pool (docs/kv-tiers.md), per worker that has them, from its stats, by
``tier`` (``host``, ``disk``): ``pdserve_kv_tier_blocks``, ``pdserve_kv_tier_bytes`` and
``pdserve_kv_tier_capacity_bytes`` (what each holds now and may hold),
``pdserve_kv_tier_hit_tokens_total`` (prompt tokens loaded back instead of computed: over
``pdserve_prefix_cache_queries_total`` it is the tier's hit rate),
``pdserve_kv_tier_read_bytes_total`` and ``pdserve_kv_tier_written_bytes_total`` (their
``rate()`` is bytes per second); and ``pdserve_kv_tier_evictions_total`` (blocks dropped from
the lowest tier holding them), ``pdserve_kv_tier_read_failures_total`` (blocks that failed
their check or read: recomputed), ``pdserve_kv_tier_write_failures_total`` (writes that
failed or were dropped). Counters kept by the worker.

Besides the histograms the router keeps :class:`SlidingWindow` samples of what the
autoscaler reads (percentiles and rates over its window): the router's TTFT, the ITL, the
prefill pool's part of TTFT (queue + compute + KV send at the worker) and prompt tokens.
``start_http`` serves the text format on the metrics port (``pdserve.router.metrics_http``:
behind the admin key when the router has one).
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.router.constraints import ConstraintCheck, ConstraintRefused
from pdserve.router.metrics_http import start_metrics_server
from pdserve.worker_api import KV_TIER_HOST, KV_TIER_NAMES, PrefillResult, WorkerStats
from pdserve.worker_api.adapters import AdapterRef

PREEMPTION_KINDS = ("recompute", "bounce")
LORA_LOAD_SOURCES = ("disk", "host")  # pdserve_lora_loads_total{source}
KV_TIERS_BELOW_POOL = KV_TIER_NAMES[KV_TIER_HOST:]  # pdserve_kv_tier_*{tier}
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)


class SlidingWindow:
    """Timestamped samples (value, weight) of the last ``max_age_s`` seconds, at most
    ``max_samples`` of them (the oldest go first): percentiles, counts and sums over any
    window up to that age. Times are ``time.monotonic()`` unless given."""

    def __init__(self, max_age_s: float = 600.0, max_samples: int = 50_000) -> None:
        self.max_age_s = max_age_s
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=max_samples)

    def add(self, value: float, weight: float = 1.0, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, float(value), float(weight)))
        while self._samples and self._samples[0][0] < now - self.max_age_s:
            self._samples.popleft()

    def _since(self, window_s: float, now: float | None) -> list[tuple[float, float, float]]:
        start = (time.monotonic() if now is None else now) - window_s
        times = [t for t, _, _ in self._samples]
        return list(self._samples)[bisect.bisect_left(times, start):]

    def quantile(self, q: float, window_s: float, now: float | None = None) -> float | None:
        """The weighted ``q``-quantile (0..1) of the window's values; None when empty."""
        samples = sorted((v, w) for _, v, w in self._since(window_s, now))
        total = sum(w for _, w in samples)
        if not samples or total <= 0:
            return None
        seen = 0.0
        for value, weight in samples:
            seen += weight
            if seen >= q * total:
                return value
        return samples[-1][0]

    def count(self, window_s: float, now: float | None = None) -> float:
        """Sum of the weights in the window (samples, or tokens for the ITL)."""
        return sum(w for _, _, w in self._since(window_s, now))

    def total(self, window_s: float, now: float | None = None) -> float:
        """Sum of value x weight in the window."""
        return sum(v * w for _, v, w in self._since(window_s, now))


class RouterMetrics:
    """Every metric the router exports, in one registry (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._add_request_latencies()
        self._add_worker_gauges()
        self._add_cluster_metrics()
        self._add_structured_output_metrics()
        self._add_lora_metrics()
        self._add_kv_tier_metrics()
        # What the autoscaler reads (seconds; ITL weighted by tokens).
        self.ttft_window = SlidingWindow()  # the router's TTFT
        self.itl_window = SlidingWindow()  # gaps between streamed tokens
        self.prefill_ttft_window = SlidingWindow()  # queue + prefill + KV send at the worker
        self.prompt_window = SlidingWindow()  # prompt tokens per prefilled request
        self._per_worker = (self.queue, self.prefill, self.transfer, self.transfer_bytes,
                            self.running, self.waiting, self.used_blocks, self.total_blocks,
                            self.usage, self.prefix_hits, self.compute_util,
                            self.bandwidth_util, self.spec_drafts, self.spec_draft_tokens,
                            self.spec_accepted_tokens, self.lora_slots, self.lora_resident,
                            self.lora_evictions, self.prefix_queries, self.kv_tier_evictions,
                            self.kv_tier_read_failures, self.kv_tier_write_failures)
        self._per_worker_tier = (self.kv_tier_blocks, self.kv_tier_bytes,
                                 self.kv_tier_capacity, self.kv_tier_hit_tokens,
                                 self.kv_tier_read_bytes, self.kv_tier_written_bytes)

    def _add_request_latencies(self) -> None:
        """Histograms the router observes as requests flow (per worker: at the worker)."""
        r = self.registry

        def hist(name: str, doc: str, labels=("role",)) -> Histogram:
            return Histogram(f"pdserve_{name}", doc, labels, registry=r, buckets=_LATENCY_BUCKETS)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token")
        self.itl = hist("inter_token_latency_seconds", "Gap between streamed tokens")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled chunk",
                          ("role", "worker"))
        self.prefill = hist("prefill_time_seconds", "First chunk to token 0", ("role", "worker"))
        self.transfer = hist("kv_transfer_seconds", "Token 0 to KV commit sent",
                             ("role", "worker"))
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV payload bytes sent",
                                      ("role", "worker"), registry=r)

    def _add_worker_gauges(self) -> None:
        """Per-worker gauges, set from the worker stats the router refreshes."""
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pdserve_{name}", doc, ("role", "worker"), registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests queued or waiting for KV")
        self.used_blocks = gauge("kv_cache_used_blocks", "KV blocks owned by requests")
        self.total_blocks = gauge("kv_cache_total_blocks", "KV blocks in the pool")
        self.usage = gauge("kv_cache_usage_ratio", "Used / total KV blocks")
        self.prefix_hits = gauge("prefix_cache_hits_total", "Prompt tokens served by the "
                                 "prefix cache (a counter kept by the worker)")
        self.prefix_queries = gauge("prefix_cache_queries_total", "Prompt tokens looked up "
                                    "in the prefix cache (a counter kept by the worker)")
        self.preemptions = Gauge("pdserve_preemptions_total", "Preemptions by kind: recompute "
                                 "(redone on the worker) or bounce (a decode worker handed the "
                                 "request back to be re-prefilled); a counter kept by the "
                                 "worker", ("role", "worker", "kind"), registry=r)
        # speculative decoding (vLLM's names), counters kept by the decode / colocated worker
        self.spec_drafts = gauge("spec_decode_num_drafts_total", "Sequence-steps that verified "
                                 "speculative drafts (a counter kept by the worker)")
        self.spec_draft_tokens = gauge("spec_decode_num_draft_tokens_total", "Draft tokens "
                                       "proposed and verified (a counter kept by the worker)")
        self.spec_accepted_tokens = gauge("spec_decode_num_accepted_tokens_total", "Draft "
                                          "tokens the target accepted (a counter kept by the "
                                          "worker)")
        self.compute_util = gauge("worker_compute_utilization", "Achieved model FLOP/s "
                                  "while computing / the device's measured matmul peak")
        self.bandwidth_util = gauge("worker_bandwidth_utilization", "Achieved weight + KV "
                                    "bytes/s while computing / the device's measured copy "
                                    "bandwidth")

    def _add_cluster_metrics(self) -> None:
        """The router's own gauge, the fault counters and the pools'."""
        r = self.registry
        self.router_running = Gauge("pdserve_router_requests_in_flight", "Admitted requests",
                                    ("role",), registry=r)
        self.waiting_for_workers = Gauge("pdserve_router_requests_waiting_for_workers",
                                         "Admitted requests waiting for a ready worker "
                                         "(start-up, a pool being replaced)", registry=r)
        self.migrations = Counter("pdserve_request_migrations", "Requests moved to new workers "
                                  "after their first token, by why the attempt failed",
                                  ("reason",), registry=r)
        self.prefill_location = Counter("pdserve_prefill_location", "Disaggregated attempts "
                                        "by where their prompt was computed: remote (a prefill "
                                        "worker) or local (the decode worker)",
                                        ("location",), registry=r)
        self.worker_restarts = Counter("pdserve_worker_restarts", "Dead workers replaced by "
                                       "the pool manager", ("role",), registry=r)
        self.otel_spans_dropped = Counter("pdserve_otel_spans_dropped", "OpenTelemetry spans "
                                          "never delivered, by reason: queue_full (the export "
                                          "queue was full) or export_failed (the collector "
                                          "refused them or did not answer)", ("reason",),
                                          registry=r)
        self.requests_failed = Counter("pdserve_requests_failed", "Generate calls that ended "
                                       "with an error, by gRPC status code name",
                                       ("code",), registry=r)
        self.pool_target = Gauge("pdserve_pool_target_workers", "Target size of each pool",
                                 ("role",), registry=r)
        self.pool_workers = Gauge("pdserve_pool_workers", "Workers of each pool by state "
                                  "(starting, ready, draining, dead)", ("role", "state"),
                                  registry=r)
        self.autoscaler_decisions = Counter("pdserve_autoscaler_decisions", "Pool target "
                                            "steps by the autoscaler, by the signal that "
                                            "moved it", ("role", "direction", "reason"),
                                            registry=r)
        self.control_plane_degraded = Gauge("pdserve_control_plane_degraded", "1 while the "
                                            "router cannot reach the cluster's shared state "
                                            "(Redis): it serves with the workers it knows",
                                            registry=r)
        self.malformed_records = Counter("pdserve_malformed_records", "Records in Redis "
                                         "skipped because they did not parse or broke a "
                                         "bound, by key family", ("family",), registry=r)
        self.untrusted_records = Counter("pdserve_untrusted_records", "Values read from Redis "
                                         "skipped because their tag did not verify under the "
                                         "cluster's key, by kind (worker, draining, kv_event)",
                                         ("kind",), registry=r)
        self.control_plane_repairs = Counter("pdserve_control_plane_repairs", "Values put "
                                             "back in Redis after it lost them or held them "
                                             "malformed, by key family", ("family",),
                                             registry=r)

    def _add_structured_output_metrics(self) -> None:
        """The router's checks of requests' constraints (``router.constraints``)."""
        r = self.registry
        self.grammar_compiles = Counter("pdserve_structured_output_compiles", "Constraints the "
                                        "router compiled to check them", registry=r)
        self.grammar_cache_hits = Counter("pdserve_structured_output_cache_hits", "Constraint "
                                          "checks answered from the router's cache", registry=r)
        self.grammar_compile = Histogram("pdserve_structured_output_compile_seconds", "Time "
                                         "the router's check took to compile a constraint",
                                         registry=r, buckets=_LATENCY_BUCKETS)
        self.grammar_invalid = Counter("pdserve_structured_output_invalid_requests", "Requests "
                                       "refused because their constraint does not compile "
                                       "(does_not_compile) or not in time (too_complex)",
                                       ("reason",), registry=r)

    def _add_lora_metrics(self) -> None:
        """LoRA adapters: per worker from its stats (counters kept by the worker), per adapter
        counted by the router."""
        r = self.registry

        def gauge(name: str, doc: str, labels=("role", "worker")) -> Gauge:
            return Gauge(f"pdserve_{name}", doc, labels, registry=r)

        self.lora_slots = gauge("lora_slots", "Adapter slots in the worker's model (max_loras)")
        self.lora_resident = gauge("lora_resident_adapters", "Adapters in a slot, ready for a "
                                   "step")
        self.lora_loads = gauge("lora_loads_total", "Adapters loaded, by source: disk (read "
                                "from their files) or host (put into a slot from host memory, "
                                "no file read); a counter kept by the worker",
                                ("role", "worker", "source"))
        self.lora_evictions = gauge("lora_evictions_total", "Adapters taken out of a slot for "
                                    "another (a counter kept by the worker)")
        self.lora_requests = Counter("pdserve_lora_requests", "Requests the router admitted "
                                     "under each LoRA adapter, by its served name (base-model "
                                     "requests are not counted)", ("adapter",), registry=r)

    def _add_kv_tier_metrics(self) -> None:
        """KV tiers below the pool, per worker and tier from its stats (see the module
        docstring)."""
        r = self.registry

        def gauge(name: str, doc: str, by_tier: bool = True) -> Gauge:
            labels = ("role", "worker", "tier") if by_tier else ("role", "worker")
            return Gauge(f"pdserve_kv_tier_{name}", doc, labels, registry=r)

        self.kv_tier_blocks = gauge("blocks", "KV blocks the tier holds")
        self.kv_tier_bytes = gauge("bytes", "Bytes of KV blocks the tier holds")
        self.kv_tier_capacity = gauge("capacity_bytes", "The tier's budget in bytes")
        self.kv_tier_hit_tokens = gauge("hit_tokens_total", "Prompt tokens loaded back from the "
                                        "tier instead of computed (a counter kept by the "
                                        "worker)")
        self.kv_tier_read_bytes = gauge("read_bytes_total", "Bytes read back from the tier (a "
                                        "counter kept by the worker)")
        self.kv_tier_written_bytes = gauge("written_bytes_total", "Bytes written into the tier "
                                           "(a counter kept by the worker)")
        self.kv_tier_evictions = gauge("evictions_total", "Blocks dropped from the lowest tier "
                                       "holding them (a counter kept by the worker)", False)
        self.kv_tier_read_failures = gauge("read_failures_total", "Blocks that failed their "
                                           "check or could not be read, recomputed instead (a "
                                           "counter kept by the worker)", False)
        self.kv_tier_write_failures = gauge("write_failures_total", "Block writes that failed "
                                            "or were dropped (a counter kept by the worker)",
                                            False)

    def observe_adapter(self, adapter: AdapterRef | None) -> None:
        """One admitted request under ``adapter`` (None: the base model, not counted)."""
        if adapter is not None:
            self.lora_requests.labels(adapter.name).inc()

    def observe_constraint_check(self, check: ConstraintCheck, refused: ConstraintRefused | None
                                 ) -> None:
        """One check of a request's constraint, and its refusal if it was refused."""
        if check.cached:
            self.grammar_cache_hits.inc()
        else:
            self.grammar_compiles.inc()
            self.grammar_compile.observe(check.compile_s)
        if refused is not None:
            reason = "too_complex" if refused.is_too_complex else "does_not_compile"
            self.grammar_invalid.labels(reason).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels("router").observe(seconds)
        self.ttft_window.add(seconds)

    def observe_itl(self, gap_s: float, num_tokens: int = 1) -> None:
        """``num_tokens`` tokens arrived ``gap_s`` apart each."""
        for _ in range(num_tokens):
            self.itl.labels("router").observe(gap_s)
        self.itl_window.add(gap_s, num_tokens)

    def set_pools(self, targets: dict[str, int], workers: dict[tuple[str, str], int]) -> None:
        """Pool gauges: role -> target, (role, state) -> workers (missing states count 0)."""
        for role, target in targets.items():
            self.pool_target.labels(role).set(target)
        for role in {r for r, _ in workers} | set(targets):
            for state in ("starting", "ready", "draining", "dead"):
                self.pool_workers.labels(role, state).set(workers.get((role, state), 0))

    def observe_prefill(self, worker_id: str, result: PrefillResult) -> None:
        labels = ("prefill", worker_id)
        self.prefill_ttft_window.add(result.queue_time_s + result.prefill_time_s
                                     + result.transfer_time_s)
        self.prompt_window.add(result.first.num_prompt_tokens)
        self.queue.labels(*labels).observe(result.queue_time_s)
        self.prefill.labels(*labels).observe(result.prefill_time_s)
        self.transfer.labels(*labels).observe(result.transfer_time_s)
        self.transfer_bytes.labels(*labels).inc(result.transfer_bytes)

    def set_worker(self, stats: WorkerStats) -> None:
        labels = (stats.role, stats.worker_id)
        self.running.labels(*labels).set(stats.num_running)
        self.waiting.labels(*labels).set(stats.num_waiting)
        self.used_blocks.labels(*labels).set(stats.used_blocks)
        self.total_blocks.labels(*labels).set(stats.total_blocks)
        self.usage.labels(*labels).set(stats.used_blocks / max(1, stats.total_blocks))
        self.prefix_hits.labels(*labels).set(stats.prefix_hit_tokens)
        self.prefix_queries.labels(*labels).set(stats.prefix_query_tokens)
        self.preemptions.labels(*labels, "recompute").set(stats.num_preemptions
                                                          - stats.num_bounces)
        self.preemptions.labels(*labels, "bounce").set(stats.num_bounces)
        if stats.spec_num_drafts:
            self.spec_drafts.labels(*labels).set(stats.spec_num_drafts)
            self.spec_draft_tokens.labels(*labels).set(stats.spec_num_draft_tokens)
            self.spec_accepted_tokens.labels(*labels).set(stats.spec_num_accepted_tokens)
        util = stats.utilization
        self.compute_util.labels(*labels).set(util.compute)
        self.bandwidth_util.labels(*labels).set(util.bandwidth)
        if stats.lora_slots:
            self._set_lora(labels, stats)
        if stats.kv_host_capacity_bytes or stats.kv_disk_capacity_bytes:
            self._set_kv_tiers(labels, stats)

    def _set_kv_tiers(self, labels: tuple[str, str], stats: WorkerStats) -> None:
        """A worker's KV tiers: each tier's series from its stats fields ``kv_<tier>_*``."""
        names = ("blocks", "bytes", "capacity_bytes", "hit_tokens", "read_bytes",
                 "written_bytes")  # in the order of self._per_worker_tier
        for tier in KV_TIERS_BELOW_POOL:
            for metric, name in zip(self._per_worker_tier, names, strict=True):
                metric.labels(*labels, tier).set(getattr(stats, f"kv_{tier}_{name}"))
        self.kv_tier_evictions.labels(*labels).set(stats.kv_tier_evictions)
        self.kv_tier_read_failures.labels(*labels).set(stats.kv_tier_read_failures)
        self.kv_tier_write_failures.labels(*labels).set(stats.kv_tier_write_failures)

    def _set_lora(self, labels: tuple[str, str], stats: WorkerStats) -> None:
        """A LoRA worker's slots and counters (a slot load that read no file: from host)."""
        self.lora_slots.labels(*labels).set(stats.lora_slots)
        self.lora_resident.labels(*labels).set(len(stats.lora_resident))
        self.lora_loads.labels(*labels, "disk").set(stats.lora_disk_reads)
        self.lora_loads.labels(*labels, "host").set(max(0, stats.lora_slot_loads
                                                        - stats.lora_disk_reads))
        self.lora_evictions.labels(*labels).set(stats.lora_evictions)

    def remove_worker(self, role: str, worker_id: str) -> None:
        """Drop every per-worker series of a worker that left (dashboards forget it)."""
        for metric in self._per_worker:
            try:
                metric.remove(role, worker_id)
            except KeyError:  # that series was never observed
                pass
        for metric, kinds in ((self.preemptions, PREEMPTION_KINDS),
                              (self.lora_loads, LORA_LOAD_SOURCES),
                              *((m, KV_TIERS_BELOW_POOL) for m in self._per_worker_tier)):
            for kind in kinds:
                try:
                    metric.remove(role, worker_id, kind)
                except KeyError:
                    pass

    def start_http(self, port: int, host: str = "127.0.0.1", admin_api_key: str | None = None):
        """Serve /metrics (with ``admin_api_key``: only to scrapes sending it); returns
        (server, thread)."""
        return start_metrics_server(self.registry, port, host, admin_api_key)
