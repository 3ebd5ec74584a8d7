"""``pdserve status --checklist``: the ledger of a running cluster, from its Admin service.

1. Phase share of time: where the latest requests' end-to-end time went (router traces:
   queue, prefill, transfer, router, decode; :mod:`pdserve.bench.phases`).
2. Utilisation per phase: each role's achieved FLOP rate against its measured matmul peak and
   achieved bytes per second against its measured copy bandwidth (recent forward passes), how
   busy it is, and which of the two binds.
3. Memory composition per worker: weights, activations, KV pool and margin of its budget.
"""

from __future__ import annotations

import json

from pdserve.api.admin_client import trace_dict
from pdserve.bench.phases import PHASES, adapter_loads, format_adapter_loads, phase_split
from pdserve.bench.stats import format_table

MiB = 1 << 20


def format_checklist(traces: list | None, workers: list) -> str:
    """``traces``: Admin ``RequestTrace`` messages (None: the server keeps none);
    ``workers``: Admin ``Worker`` messages."""

    lines = [f"1. phase share of time ({len(traces or ())} latest requests, router traces)"]
    if traces is None:
        lines.append("this server keeps no request traces")
    elif traces:
        rows = [trace_dict(t) for t in traces]
        split = phase_split(rows)
        lines.append(format_table(["phase", "share", "mean ms", "P99 ms"],
                                  [[p, f"{split[p]['share']:.1%}", split[p]["mean_ms"],
                                    split[p]["p99_ms"]] for p in PHASES]))
        loads = adapter_loads(rows)
        if loads is not None:
            lines.append(format_adapter_loads(loads))
    else:
        lines.append("no finished requests yet")
    lines += ["", "2. utilisation per phase (recent forward passes against measured peaks)",
              utilisation_table(workers), "", "3. memory composition per worker",
              memory_table(workers)]
    return "\n".join(lines)


def utilisation_table(workers: list) -> str:
    rows = []
    for role in sorted({w.role for w in workers}):
        live = [w for w in workers if w.role == role and w.binding]
        if not live:
            continue
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        compute = mean([w.compute_utilization for w in live])
        bandwidth = mean([w.bandwidth_utilization for w in live])
        rows.append([role, len(live), f"{compute:.1%}", f"{bandwidth:.1%}",
                     f"{mean([w.busy_fraction for w in live]):.0%}",
                     ", ".join(sorted({w.binding for w in live}))])
    return format_table(["role", "workers", "compute", "bandwidth", "busy", "binds"], rows)


def memory_table(workers: list) -> str:
    rows = []
    for w in workers:
        ledger = json.loads(w.ledger_json or "{}")
        if not ledger:
            continue
        budget = ledger.get("budget_bytes", 0) or 1
        parts = [ledger.get(k, 0) for k in ("weight_bytes", "activation_bytes", "kv_pool_bytes",
                                             "margin_bytes")]
        rows.append([w.worker_id, w.role, budget / MiB,
                     *[f"{p / MiB:.3g} ({p / budget:.0%})" for p in parts],
                     f"{ledger.get('num_kv_blocks', 0)} x {ledger.get('block_size', '?')}"])
    return format_table(["worker", "role", "budget MiB", "weights MiB", "activations MiB",
                         "KV pool MiB", "margin MiB", "KV blocks x tokens"], rows)
