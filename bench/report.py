"""Printed forms of the benchmark results (``pdserve bench serve`` / ``compare``)."""

from __future__ import annotations

import json
import math

from pdserve.bench.phases import PHASES, format_prefill_locations
from pdserve.bench.stats import format_table

_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
MiB = 1 << 20


def _line(label: str, value) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value}"


def format_serve(result: dict) -> str:
    """vLLM's result block, then pdserve's per-phase split and per-worker binding."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             _line("Successful requests:", result["completed"]),
             _line("Failed requests:", result["failed"]),
             _line("Benchmark duration (s):", result["duration"]),
             _line("Total input tokens:", result["total_input_tokens"]),
             _line("Total generated tokens:", result["total_output_tokens"]),
             _line("Request throughput (req/s):", result["request_throughput"])]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"]))
        lines.append(_line("SLO attainment:", f"{result['slo_attainment']:.1%}"))
    lines += [_line("Output token throughput (tok/s):", result["output_throughput"]),
              _line("Total Token throughput (tok/s):", result["total_token_throughput"])]
    if result.get("prefix_hit_rate") is not None:
        lines.append(_line("Prefix cache hit rate:", f"{result['prefix_hit_rate']:.1%}"))
    for metric, title in _TITLES.items():
        keys = [k for k in result if k.endswith(f"_{metric}_ms")]
        if not keys:
            continue
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for key in keys:
            stat = key.split("_", 1)[0]
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(stat, stat.upper())
            lines.append(_line(f"{label} {metric.upper()} (ms):", result[key]))
    lines.append("=" * 50)
    if result.get("phases"):
        lines += ["", f"where the time went (router traces of {result['num_traces']} requests; "
                      "router = TTFT no worker timed)", format_phases(result["phases"])]
    if result.get("prefill_locations"):
        lines.append(format_prefill_locations(result["prefill_locations"]))
    if result.get("workers"):
        lines += ["", "workers while serving (sampled each second)",
                  format_workers(result["workers"])]
    errors = sorted({e for e in result.get("errors", []) if e})
    if errors:
        lines += ["", "errors: " + "; ".join(errors[:5])]
    return "\n".join(lines)


def format_phases(phases: dict) -> str:
    return format_table(["phase", "share", "mean ms", "P50 ms", "P99 ms"],
                        [[p, f"{phases[p]['share']:.1%}", phases[p]["mean_ms"],
                          phases[p]["p50_ms"], phases[p]["p99_ms"]] for p in PHASES])


def format_workers(workers: dict) -> str:
    rows = []
    for worker_id, w in sorted(workers.items()):
        ledger = w.get("ledger", {})
        rows.append([worker_id, w["role"], _pct(w.get("compute_utilization")),
                     _pct(w.get("bandwidth_utilization")), _pct(w.get("busy_fraction")),
                     w.get("binding", "-"), ledger.get("weight_bytes", 0) / MiB,
                     ledger.get("kv_pool_bytes", 0) / MiB, ledger.get("num_kv_blocks", "-")])
    return format_table(["worker", "role", "compute", "bandwidth", "busy", "binds",
                         "weights MiB", "KV pool MiB", "KV blocks"], rows)


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def dump_json(result: dict, path: str) -> None:
    """Write ``result`` as strict JSON (infinities as the string "inf", as vLLM writes them)."""
    with open(path, "w") as f:
        json.dump(finite(result), f, indent=1, sort_keys=True)
        f.write("\n")


def finite(value):
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return "inf" if value > 0 else ("-inf" if value < 0 else None)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def format_compare(doc: dict) -> str:
    """Per rate, the modes side by side; then the headline (highest rate at the target
    attainment per mode, and each one's ratio to colocated's)."""
    table, modes = doc["table"], list(doc["table"])
    rates = sorted({r for m in modes for r in table[m]}, key=float)
    cols = {"p99_ttft_ms": "P99 TTFT", "p99_tpot_ms": "P99 TPOT", "p99_itl_ms": "P99 ITL",
            "request_goodput": "goodput", "slo_attainment": "attain"}
    short = {"disaggregated": "disagg", "colocated": "coloc"}
    header = ["rate"] + [f"{short.get(m, m)} {col}" for col in cols.values() for m in modes]
    rows = []
    for r in rates:
        row = [f"{float(r):g}"]
        for key in cols:
            for m in modes:
                value = table[m].get(r, {}).get(key)
                row.append(f"{value:.0%}" if key == "slo_attainment" and value is not None
                           else value)
        rows.append(row)
    slos = ", ".join(f"{k} <= {v:.0f} ms" for k, v in doc["slos_ms"].items())
    target = doc["attainment_target"]
    lines = [f"SLOs: {slos}" + (" (derived from the better mode's medians at the lowest rate:"
                                " TTFT x 3, TPOT x 2)" if doc["slos_derived"] else ""),
             "(ms; goodput in req/s; attain = requests meeting every SLO / sent)",
             format_table(header, rows), ""]
    for m in modes:
        best = doc["best_rate"][m]
        lines.append(f"{m}: highest rate at >= {target:.0%} SLO attainment: "
                     + (f"{best:g} req/s" if best is not None else "none of the rates swept"))
    ratios = doc.get("ratios") or {"disaggregated": doc.get("ratio")}  # (older documents)
    for m, ratio in ratios.items():
        if "colocated" in modes and m in modes:
            lines.append(f"{m} / colocated: " + (f"{ratio:.2f}x" if ratio is not None else
                                                 "n/a (a mode met the target at no rate)"))
    return "\n".join(lines)


USEFUL_STEP_MS = 60_000.0  # a step slower than a minute is no serving plan: say why instead


def _useless(ms: float, plan: dict) -> str:
    hw = plan["hardware"]
    return (f"not servable: {ms / 1000:,.0f} s a step at {hw['peak_flops_per_s'] / 1e9:,.3g} "
            f"GFLOPS ({plan['dtype']} on {hw['name']}); plan for an accelerator (--device "
            f"NAME) or a dtype this device computes fast (--dtype float32 on a CPU)")


def format_plan(plan: dict) -> str:
    hw = plan["hardware"]
    gib = lambda b: f"{b / (1 << 30):,.2f} GiB"  # noqa: E731
    d, p = plan["decode"], plan["prefill"]
    ranks = plan["tensor_parallel_size"]
    speed = ("speed unknown" if hw["bandwidth_bytes_per_s"] is None
             else f"{hw['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s, "
                  f"{hw['peak_flops_per_s'] / 1e12:,.1f} TFLOPS")
    untimed = "needs the device's speed: name it with --device NAME, or give --hbm-gbps " \
              "and --tflops"
    rows = [
        ["hardware", f"{hw['name']}: {gib(hw['memory_bytes'])}, {speed} ({hw['source']})"],
        ["model", f"{plan['model']} ({plan['model_type']}, {plan['num_parameters']:,} "
                  f"parameters, {plan['dtype']}, KV {plan['kv_cache_dtype']})"],
        *([["tensor parallel", f"{ranks} devices per worker; weights, KV, batch and step "
                                f"times below are one rank's (collectives not counted)"]]
          if ranks > 1 else []),
        ["weights", f"{gib(plan['weight_bytes'])} (from the {plan['weights_counted_from']})"],
        ["activation reserve", f"{gib(plan['activation_reserve_bytes'])} "
                               f"({plan['activation_reserve_from']})"],
        ["safety margin", gib(plan["margin_bytes"])],
        ["KV pool", f"{gib(plan['kv_pool_bytes'])} = {plan['num_kv_blocks']:,} blocks x "
                    f"{plan['block_size']} tokens"],
        ["KV bytes per token", f"{plan['kv_bytes_per_token']:,} B"],
        ["max batch", f"{plan['max_batch_theoretical']:,} at {plan['avg_context']:,} tokens "
                      f"each; {plan['max_batch']:,} with the 20 % margin"],
        ["decode step", untimed if d is None else
         f"{d['ms']:.3g} ms at batch {d['batch']:,} (memory {d['memory_ms']:.3g}"
         f" ms, compute {d['compute_ms']:.3g} ms): {d['binding']}-bound, "
         f"{plan['decode_tokens_per_s']:,.0f} tokens/s per worker"
         if d["ms"] <= USEFUL_STEP_MS else _useless(d["ms"], plan)],
        ["prefill per 1k tokens", untimed if p is None else
         f"{plan['prefill_ms_per_1k_tokens']:.3g} ms (compute "
         f"{p['compute_ms']:.3g} ms at MFU {plan['mfu']:g}, memory "
         f"{p['memory_ms']:.3g} ms): {p['binding']}-bound"
         if plan["prefill_ms_per_1k_tokens"] <= USEFUL_STEP_MS
         else _useless(plan["prefill_ms_per_1k_tokens"], plan)],
    ]
    if "num_prefill_workers" in plan:
        rows.append([f"workers for {plan['rate']:g} req/s",
                     f"{plan['num_prefill_workers']} prefill + {plan['num_decode_workers']} "
                     f"decode (P:D {plan['pd_ratio']}; {plan['isl']} in / {plan['osl']} out, "
                     f"{plan['requests_decoding']:.1f} requests decoding at once)"
                     + (f", {plan['num_devices']} devices" if ranks > 1 else "")])
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{label:<{width}}  {text}" for label, text in rows)


def format_measure(measured: dict) -> str:
    rows = []
    for r in measured["rows"]:
        gemv = r.get("predicted_gemv")
        rows.append([r["what"], r["predicted"], "-" if gemv is None else gemv, r["measured"],
                     "-" if r["measured_over_predicted"] is None
                     else r["measured_over_predicted"],
                     "-" if gemv is None else r["measured"] / gemv, r.get("binding", "")])
    return (format_table(["", "predicted", "at GEMV bw", "measured", "/ predicted",
                          "/ at GEMV bw", "binding"], rows)
            + f"\n(torch threads {measured['threads']}; measured: matmul "
              f"{measured['matmul_flops_per_s'] / 1e9:,.0f} GFLOP/s, copy "
              f"{measured['copy_bytes_per_s'] / 1e9:,.1f} GB/s, one-row linear "
              f"{measured['gemv_bytes_per_s'] / 1e9:,.1f} GB/s; prefill reached "
              f"{measured['achieved_matmul_fraction_in_prefill']:.0%} of the matmul rate)")
