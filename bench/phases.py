"""Where requests' time went: the per-phase split of router traces.

A trace (``pdserve.router.trace.RequestTrace``, or the dict ``api.admin_client.trace_dict``
makes of one) holds ``queue``, ``prefill``, ``transfer`` (disaggregated only) and ``decode``
seconds, with ``ttft`` and ``e2e``. The rest of TTFT, ``router``, is what no worker timed:
admission and placing (the router's waiting queue, the decode reservation), RPCs and polling.
So queue + prefill + transfer + router = TTFT and TTFT + decode = e2e for every request.
"""

from __future__ import annotations

import dataclasses

from pdserve.bench.stats import percentile

PHASES = ("queue", "prefill", "transfer", "router", "decode")


def as_dict(trace) -> dict:
    return dataclasses.asdict(trace) if dataclasses.is_dataclass(trace) else dict(trace)


def phase_seconds(trace) -> dict[str, float]:
    """phase -> seconds of one trace (see the module docstring)."""
    t = as_dict(trace)
    worker = t["queue"] + t["prefill"] + t["transfer"]
    return {"queue": t["queue"], "prefill": t["prefill"], "transfer": t["transfer"],
            "router": max(0.0, t["ttft"] - worker), "decode": t["decode"]}


def phase_split(traces) -> dict[str, dict[str, float]]:
    """phase -> {"mean_ms", "p50_ms", "p99_ms", "share"} over ``traces``; ``share`` is the
    phase's part of the summed end-to-end time."""
    per = [phase_seconds(t) for t in traces]
    total = sum(sum(p.values()) for p in per) or float("nan")
    out = {}
    for phase in PHASES:
        values = [p[phase] for p in per]
        out[phase] = {"mean_ms": 1e3 * sum(values) / len(values) if values else float("nan"),
                      "p50_ms": 1e3 * percentile(values, 50),
                      "p99_ms": 1e3 * percentile(values, 99), "share": sum(values) / total}
    return out


def prefill_locations(traces) -> dict[str, int] | None:
    """How many of ``traces`` had their prompt computed where: {"remote": n, "local": m}
    (conditional disaggregation); None when no trace says (colocated workers, an older
    server)."""
    counts = {"remote": 0, "local": 0}
    for trace in traces:
        where = _location(as_dict(trace).get("prefill_location"))
        if where in counts:
            counts[where] += 1
    return counts if any(counts.values()) else None


def _location(value) -> str | None:
    """A trace's location: a string (Admin's dict) or a ``PrefillLocation`` (as a dict)."""
    return value.get("location") if isinstance(value, dict) else value


def adapter_loads(traces) -> dict[str, int] | None:
    """How many of ``traces`` ran under a LoRA adapter a worker already held ("resident":
    in a slot, or sent there just before) and how many had it loaded for them ("loaded":
    from host memory or its files); None when no trace ran under an adapter. A trace is a
    ``RequestTrace`` or Admin's dict (its ``*_adapter_source`` fields)."""
    counts = {"resident": 0, "loaded": 0}
    for trace in traces:
        loaded = _adapter_loaded(trace)
        if loaded is not None:
            counts["loaded" if loaded else "resident"] += 1
    return counts if any(counts.values()) else None


def _adapter_loaded(trace) -> bool | None:
    if not dataclasses.is_dataclass(trace):
        if not trace.get("adapter"):
            return None
        sources = (trace.get("prefill_adapter_source"), trace.get("decode_adapter_source"))
        return any(source in ("host", "disk") for source in sources)
    return trace.adapter_loaded


def format_adapter_loads(counts: dict[str, int]) -> str:
    return (f"requests under a LoRA adapter: {counts['resident']} found it resident, "
            f"{counts['loaded']} had it loaded for them")


def format_prefill_locations(counts: dict[str, int]) -> str:
    return (f"prompts computed on a prefill worker (KV shipped): {counts['remote']}, on the "
            f"decode worker itself: {counts['local']} (--disaggregation)")
