"""Prometheus metrics (prefix ``pdserve_``, label ``role``, and ``worker`` where per worker).

Latency histograms are observed by the router as requests flow; per-worker gauges and
counters are set from the worker stats the router refreshes, and removed
(:meth:`RouterMetrics.remove_worker`) when a worker leaves, so dashboards drop dead workers.
Fault counters: ``pdserve_request_migrations_total{reason}`` (the router core),
``pdserve_worker_restarts_total{role}`` (the pool manager, in the router's process) and
``pdserve_requests_failed_total{code}`` (the gRPC front door, by status code name).
``start_http`` serves the text format on the metrics port.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdserve.engine.messages import PrefillResult, WorkerStats

PREEMPTION_KINDS = ("recompute", "bounce")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str, labels=("role",)) -> Histogram:
            return Histogram(f"pdserve_{name}", doc, labels, registry=r, buckets=_LATENCY_BUCKETS)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pdserve_{name}", doc, ("role", "worker"), registry=r)

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
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests queued or waiting for KV")
        self.used_blocks = gauge("kv_cache_used_blocks", "KV blocks owned by requests")
        self.total_blocks = gauge("kv_cache_total_blocks", "KV blocks in the pool")
        self.usage = gauge("kv_cache_usage_ratio", "Used / total KV blocks")
        self.prefix_hits = gauge("prefix_cache_hits_total", "Prompt tokens served by the "
                                 "prefix cache (a counter kept by the worker)")
        self.preemptions = Gauge("pdserve_preemptions_total", "Preemptions by kind: recompute "
                                 "(redone on the worker) or bounce (a decode worker handed the "
                                 "request back to be re-prefilled); a counter kept by the "
                                 "worker", ("role", "worker", "kind"), registry=r)
        self.compute_util = gauge("worker_compute_utilization", "Achieved model FLOP/s "
                                  "while computing / the device's measured matmul peak")
        self.bandwidth_util = gauge("worker_bandwidth_utilization", "Achieved weight + KV "
                                    "bytes/s while computing / the device's measured copy "
                                    "bandwidth")
        self.router_running = Gauge("pdserve_router_requests_in_flight", "Admitted requests",
                                    ("role",), registry=r)
        self.migrations = Counter("pdserve_request_migrations", "Requests moved to new workers "
                                  "after their first token, by why the attempt failed",
                                  ("reason",), registry=r)
        self.worker_restarts = Counter("pdserve_worker_restarts", "Dead workers replaced by "
                                       "the pool manager", ("role",), registry=r)
        self.requests_failed = Counter("pdserve_requests_failed", "Generate calls that ended "
                                       "with an error, by gRPC status code name",
                                       ("code",), registry=r)
        self._per_worker = (self.queue, self.prefill, self.transfer, self.transfer_bytes,
                            self.running, self.waiting, self.used_blocks, self.total_blocks,
                            self.usage, self.prefix_hits, self.compute_util,
                            self.bandwidth_util)

    def observe_prefill(self, worker_id: str, result: PrefillResult) -> None:
        labels = ("prefill", worker_id)
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
        self.preemptions.labels(*labels, "recompute").set(stats.num_preemptions
                                                          - stats.num_bounces)
        self.preemptions.labels(*labels, "bounce").set(stats.num_bounces)
        util = stats.utilization
        self.compute_util.labels(*labels).set(util.compute)
        self.bandwidth_util.labels(*labels).set(util.bandwidth)

    def remove_worker(self, role: str, worker_id: str) -> None:
        """Drop every per-worker series of a worker that left (dashboards forget it)."""
        for metric in self._per_worker:
            try:
                metric.remove(role, worker_id)
            except KeyError:  # that series was never observed
                pass
        for kind in PREEMPTION_KINDS:
            try:
                self.preemptions.remove(role, worker_id, kind)
            except KeyError:
                pass

    def start_http(self, port: int, host: str = "127.0.0.1"):
        """Serve /metrics; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)
