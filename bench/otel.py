"""What OpenTelemetry traces cost: ``python -m pdserve.bench.otel [--model DIR] [--sittings 2]``.

The peer workload (``bench.peer``'s: ``--input-len`` 256 prompt tokens, ``--output-len`` 64
output tokens each, greedy with ignore_eos, closed loop at each ``--concurrency``) through
``pdserve-1p1d`` (one prefill and one decode worker, one CPU each; the OpenAI front door),
once with tracing off and once with every request traced (``--otlp-traces-endpoint``) to an
OTLP/gRPC receiver in this process (:class:`OtlpReceiver`, which counts the spans it is sent).
Each sitting starts a cluster per mode, in a shuffled order, and draws new prompts, so the
two modes compare figures taken minutes apart on the same cores. Prints output tok/s, TTFT P50
and TPOT P50 per mode, each on-figure beside its ratio to the off-figure of the same sitting,
and the spans received. Never asserts; not part of ``make test``.
"""

from __future__ import annotations

import argparse
import logging
import random
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.bench.serve import ServeOptions, run_serve
from pdserve.bench.stats import format_table
from pdserve.bench.workload import SyntheticShape
from pdserve.cluster.launcher import ClusterOptions, EmbeddedCluster
from pdserve.models import tiny_model_dir
from pdserve.router.config import RouterConfig

FIGURES = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT P50 ms"),
           ("median_tpot_ms", "TPOT P50 ms"))


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on loopback that keeps every span it is sent
    (``opentelemetry.proto.trace.v1.Span``); ``endpoint`` is what a router exports to."""

    def __init__(self) -> None:
        self.spans: list = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        with self._lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list:
        """The spans received of one trace."""
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        self.server.stop(0)


def run_mode(model: str, endpoint: str | None, shape: SyntheticShape, concurrency: list[int],
             num_prompts: int, seed: int) -> dict[int, dict]:
    """The workload at each concurrency through a fresh 1P1D cluster (traced to ``endpoint``,
    None: off)."""
    options = ClusterOptions(model=model, num_prefill=1, num_decode=1, port=0, http_port=0,
                             metrics_port=None, engine=dict(dtype="float32"),
                             router=RouterConfig(otlp_traces_endpoint=endpoint))
    results = {}
    with EmbeddedCluster(options) as cluster:
        for i, c in enumerate(concurrency):
            opts = ServeOptions(target=cluster.target, base_url=cluster.http_url,
                                wait_ready_s=120, num_prompts=num_prompts, max_concurrency=c,
                                seed=seed + i, shape=shape, disable_tqdm=True)
            results[c] = run_serve(opts)
    return results


def table(sittings: list[dict[str, dict[int, dict]]], spans: list[int]) -> str:
    rows = []
    for n, (sitting, received) in enumerate(zip(sittings, spans, strict=True), 1):
        for c in sorted(sitting["off"]):
            for mode in ("off", "on"):
                result, base = sitting[mode][c], sitting["off"][c]
                row = [n, c, mode]
                for key, _label in FIGURES:
                    ratio = f" ({result[key] / base[key]:.3f}x)" if mode == "on" else ""
                    row.append(f"{result[key]:,.1f}{ratio}")
                row.append(received if mode == "on" else "-")
                rows.append(row)
    return format_table(["sitting", "concurrency", "tracing",
                         *(label for _key, label in FIGURES), "spans received"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--sittings", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    model = args.model or str(tiny_model_dir())
    shape = SyntheticShape(input_mean=args.input_len, output_mean=args.output_len, sigma=0.0)
    receiver = OtlpReceiver()
    rng = random.Random(args.seed)
    sittings, spans = [], []
    try:
        for n in range(args.sittings):
            modes = ["off", "on"]
            rng.shuffle(modes)
            sitting, before = {}, len(receiver.spans)
            for mode in modes:
                # every run its own prompts (a repeat would be served from the prefix cache)
                seed = args.seed + 1000 * n + 100 * modes.index(mode)
                endpoint = receiver.endpoint if mode == "on" else None
                sitting[mode] = run_mode(model, endpoint, shape, args.concurrency,
                                         args.num_prompts, seed)
            sittings.append(sitting)
            spans.append(len(receiver.spans) - before)
    finally:
        receiver.stop()
    print(f"model {model}; modes per sitting in a shuffled order (seed {args.seed})")
    print(table(sittings, spans))


if __name__ == "__main__":
    main()
