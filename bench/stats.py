"""Small helpers for latency summaries, timing a call and printed tables."""

from __future__ import annotations

import math
import random
import statistics
import time


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float]:
    """mean, P50, P90, P99 of ``values``."""
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def median_s(fn, passes: int, warmups: int = 2) -> float:
    """The median seconds of ``passes`` calls of ``fn`` after ``warmups`` untimed ones."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def format_table(header: list[str], rows: list[list]) -> str:
    """Plain aligned text table."""
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value) -> str:
    """Floats to 3 significant digits (whole numbers from 100 up, never an exponent there)."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        size = abs(value)
        if size >= 100:
            return f"{value:,.0f}"
        if size >= 1:
            return f"{value:.{2 if size < 10 else 1}f}"
        return f"{value:.3g}"
    return str(value)


def lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float = 0.8,
                      low: int = 1, high: int = 4096) -> list[int]:
    """Long-tailed lengths (ShareGPT-like) with the given mean, clipped to [low, high]."""
    mu = math.log(mean) - sigma * sigma / 2
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]
