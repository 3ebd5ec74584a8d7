"""One table from the reports of ``run.sh``: each tool's own TTFT, ITL, TPOT and throughput.

``python -m pdserve.bench.load_tools.summary ROOT`` reads every ``ROOT/TOOL-cC-rR`` folder
(``run.sh``'s OUT_DIR: tool, concurrency, repetition), takes from each report the figures the
tool itself printed, and writes ``ROOT/summary.json`` and a markdown table on stdout: per tool
and concurrency, each figure's value in every repetition (their spread is the run-to-run
spread) and its ratio to ``pdserve bench serve``'s mean at the same concurrency. Where
``run.sh`` scraped the server's metrics before and after (METRICS_URL), the router's own mean
TTFT and ITL over the run stand beside them: the server's view of the same requests, which
tells a client that measures differently from a server that ran slower under that client;
and the CPU seconds the client's processes used (``client-cpu.txt``), which on a machine the
client shares with the server is time the server did not get.

What each tool calls ITL differs (docs/benchmarking.md): aiperf's ``inter_token_latency`` and
guidellm's ``inter_token_latency_ms`` are per request ``(e2e - TTFT) / (tokens - 1)``, which
is pdserve's TPOT; inference-perf's ``inter_token_latency`` and pdserve's ``itl`` pool the gaps
between chunks. The table keeps the names apart: ``itl`` is a gap between chunks, ``tpot`` the
per-request average.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

FIGURES = ("ttft_p50_ms", "itl_p50_ms", "tpot_p50_ms", "output_tok_s", "server_ttft_mean_ms",
           "server_itl_mean_ms", "client_cpu_s", "completed", "failed")
SHOWN = FIGURES[:7]  # (the table's columns; completed and failed are summed)
# the router's histograms (pdserve.router.metrics): their _sum and _count over a run
SERVER_HISTOGRAMS = {"server_ttft_mean_ms": "pdserve_time_to_first_token_seconds",
                     "server_itl_mean_ms": "pdserve_inter_token_latency_seconds"}
_RUN = re.compile(r"(?P<tool>[a-z-]+)-c(?P<concurrency>\d+)-r(?P<rep>\d+)")
_BASH_TIME = re.compile(r"(\d+)m([\d.]+)s")  # bash's ``times``: 1m2.345s


def _aiperf(folder: Path) -> dict:
    doc = json.loads((folder / "profile_export_aiperf.json").read_text())
    errors = (doc.get("error_request_count") or {}).get("avg", 0)
    return {"ttft_p50_ms": doc["time_to_first_token"]["p50"],
            "itl_p50_ms": doc["inter_chunk_latency"]["p50"],
            "tpot_p50_ms": doc["inter_token_latency"]["p50"],
            "output_tok_s": doc["output_token_throughput"]["avg"],
            "completed": doc["request_count"]["avg"] - errors, "failed": errors}


def _guidellm(folder: Path) -> dict:
    doc = json.loads((folder / "guidellm.json").read_text())
    metrics = doc["benchmarks"][0]["metrics"]

    def p50(name: str) -> float:
        return metrics[name]["successful"]["median"]

    totals = doc["benchmarks"][0]["scheduler_metrics"]["requests_made"]
    return {"ttft_p50_ms": p50("time_to_first_token_ms"),
            "itl_p50_ms": None,  # (guidellm reports no gap between chunks)
            "tpot_p50_ms": p50("inter_token_latency_ms"),
            "output_tok_s": metrics["output_tokens_per_second"]["successful"]["mean"],
            "completed": totals["successful"], "failed": totals["errored"]}


def _inference_perf(folder: Path) -> dict:
    doc = json.loads((folder / "summary_lifecycle_metrics.json").read_text())
    latency = doc["successes"]["latency"]
    return {"ttft_p50_ms": latency["time_to_first_token"]["median"] * 1e3,
            "itl_p50_ms": latency["inter_token_latency"]["median"] * 1e3,
            "tpot_p50_ms": latency["time_per_output_token"]["median"] * 1e3,
            "output_tok_s": doc["successes"]["throughput"]["output_tokens_per_sec"],
            "completed": doc["successes"]["count"], "failed": doc["failures"]["count"]}


def _pdserve(folder: Path) -> dict:
    doc = json.loads((folder / "pdserve.json").read_text())
    return {"ttft_p50_ms": doc["median_ttft_ms"], "itl_p50_ms": doc["median_itl_ms"],
            "tpot_p50_ms": doc["median_tpot_ms"], "output_tok_s": doc["output_throughput"],
            "completed": doc["completed"], "failed": doc["failed"]}


READERS: dict[str, Callable[[Path], dict]] = {
    "aiperf": _aiperf, "guidellm": _guidellm, "inference-perf": _inference_perf,
    "pdserve": _pdserve}


def _scrape(path: Path) -> dict[str, float]:
    """``name_sum`` / ``name_count`` samples of the router's histograms in a scrape."""
    out = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{", 1)[0]
        if name.endswith(("_sum", "_count")) and 'role="router"' in line:
            out[name] = float(value.split()[0])
    return out


def server_side(folder: Path) -> dict[str, float | None]:
    """The router's mean TTFT and ITL over the run (None without both scrapes)."""
    try:
        before, after = (_scrape(folder / f"metrics-{when}.txt") for when in ("before", "after"))
    except OSError:
        return dict.fromkeys(SERVER_HISTOGRAMS)
    out: dict[str, float | None] = {}
    for figure, name in SERVER_HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        total = after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)
        out[figure] = total / count * 1e3 if count > 0 else None
    return out


def client_cpu_s(folder: Path) -> float | None:
    """User + system seconds of the client's processes (bash ``times``' second line)."""
    try:
        children = (folder / "client-cpu.txt").read_text().splitlines()[1]
    except (OSError, IndexError):
        return None
    return sum(int(m) * 60 + float(s) for m, s in _BASH_TIME.findall(children))


def collect(root: Path) -> dict[tuple[str, int], list[dict]]:
    """(tool, concurrency) -> the figures of each repetition, in repetition order."""
    runs: dict[tuple[str, int], list[tuple[int, dict]]] = {}
    for folder in sorted(root.iterdir()):
        match = _RUN.fullmatch(folder.name)
        if not folder.is_dir() or match is None or match["tool"] not in READERS:
            continue
        try:
            figures = READERS[match["tool"]](folder) | server_side(folder)
            figures["client_cpu_s"] = client_cpu_s(folder)
        except (OSError, KeyError, IndexError, TypeError, ValueError) as exc:
            logger.warning("%s: no report (%s: %s)", folder.name, type(exc).__name__, exc)
            continue
        key = (match["tool"], int(match["concurrency"]))
        runs.setdefault(key, []).append((int(match["rep"]), figures))
    return {key: [f for _, f in sorted(reps, key=lambda r: r[0])] for key, reps in runs.items()}


def _mean(reps: list[dict], name: str) -> float | None:
    values = [r[name] for r in reps if r[name] is not None]
    return statistics.fmean(values) if values else None


def table(runs: dict[tuple[str, int], list[dict]]) -> str:
    """Markdown: each repetition's value, then the ratio of their mean to pdserve bench's."""
    lines = ["| tool | conc | TTFT P50 ms | ITL P50 ms (chunk gaps) | TPOT P50 ms | "
             "output tok/s | router TTFT mean ms | router ITL mean ms | client CPU s | "
             "ok/failed |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for tool, concurrency in sorted(runs, key=lambda k: (k[1], k[0] != "pdserve", k[0])):
        reps = runs[(tool, concurrency)]
        base = runs.get(("pdserve", concurrency))
        cells = []
        for name in SHOWN:
            values = [r[name] for r in reps]
            if all(v is None for v in values):
                cells.append("n/a")
                continue
            text = " / ".join(f"{v:.1f}" for v in values if v is not None)
            mean, ref = _mean(reps, name), _mean(base, name) if base else None
            if tool != "pdserve" and mean is not None and ref:
                text += f" ({mean / ref:.2f}x)"
            cells.append(text)
        done = f"{sum(r['completed'] for r in reps):g}/{sum(r['failed'] for r in reps):g}"
        lines.append(f"| {tool} | {concurrency} | " + " | ".join(cells) + f" | {done} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.load_tools.summary",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the folder holding run.sh's TOOL-cC-rR runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runs = collect(args.root)
    if not runs:
        logger.error("%s: no TOOL-cC-rR folder with a report", args.root)
        return 1
    out = {f"{tool}-c{c}": reps for (tool, c), reps in sorted(runs.items())}
    (args.root / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    sys.stdout.write(table(runs) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
