"""The report of a peer sitting (``python -m pdserve.bench.peer``): every figure beside its
ratio to vLLM's at the same point of the same sitting, the issue's goals marked met or not per
row, written as markdown (``report.md``) and as one PNG per sitting (``ratios-sitting-N.png``:
the throughput and TPOT P50 ratios per point, one line per pdserve set-up).

The goals, ratios to vLLM's in one sitting:

* closed loop: output throughput >= 1.3x and TPOT P50 <= 0.8x at every concurrency, and
  TTFT P50 <= 1.0x where the concurrency is at most 8;
* Poisson: output throughput >= 1.0x at every fraction of vLLM's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.peer_grid import Point
from pdserve.bench.plots import pyplot
from pdserve.bench.stats import format_table

FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
HEADER = ["dtype", "shape", "point", "server", "output tok/s", "TTFT P50 ms", "TPOT P50 ms",
          "TPOT P99 ms", "texts = vLLM's", "goals"]


@dataclass(frozen=True)
class Goal:
    name: str  # what is asked, e.g. "TPOT P50 <= 0.8x"
    met: bool


def goals(point: Point, ratios: dict[str, float]) -> list[Goal]:
    """The issue's goals at ``point`` for a set-up whose figures are ``ratios`` x vLLM's."""
    throughput = ratios["output_throughput"]
    if not point.load.closed:
        return [Goal("throughput >= 1.0x", throughput >= 1.0)]
    marked = [Goal("throughput >= 1.3x", throughput >= 1.3),
              Goal("TPOT P50 <= 0.8x", ratios["median_tpot_ms"] <= 0.8)]
    if point.load.concurrency <= 8:
        marked.append(Goal("TTFT P50 <= 1.0x", ratios["median_ttft_ms"] <= 1.0))
    return marked


def ratios_of(result: dict, base: dict) -> dict[str, float]:
    """Each figure of ``result`` over ``base``'s (NaN where ``base``'s is zero)."""
    return {f: result[f] / base[f] if base[f] else float("nan") for f in FIGURES}


def same_texts(result: dict, reference: dict) -> str:
    """How many of ``result``'s generated texts equal ``reference``'s, request by request
    ("k/n"; "" when either saved none)."""
    texts, ref = result.get("generated_texts"), reference.get("generated_texts")
    if not texts or not ref or len(texts) != len(ref):
        return ""
    return f"{sum(a == b for a, b in zip(texts, ref, strict=True))}/{len(ref)}"


def _point_label(point: Point, result: dict) -> str:
    rate = result.get("request_rate")
    shown = f" ({rate:.2f}/s)" if isinstance(rate, int | float) else ""
    return point.load.label + shown


def _row(point: Point, server: str, result: dict, base: dict | None) -> list:
    """A table row; ``base``: vLLM's result at the point (None in vLLM's own row)."""
    ratios = ratios_of(result, base) if base is not None else None
    row = [point.dtype, point.shape.label, _point_label(point, result), server]
    for figure in FIGURES:
        row.append(f"{result[figure]:,.1f}" + (f" ({ratios[figure]:.2f}x)" if ratios else ""))
    if ratios is None:
        return [*row, "", ""]
    marked = "; ".join(f"{g.name} {'met' if g.met else 'NOT met'}"
                       for g in goals(point, ratios))
    return [*row, same_texts(result, base), marked]


def rows_of(results: dict[tuple[str, Point], dict], points: list[Point], peer: str) -> list:
    """One sitting's rows, the points in ``points``' order, ``peer`` (the sitting's vLLM
    set-up) first at each point."""
    rows = []
    for point in points:
        base = results.get((peer, point))
        servers = sorted({s for s, p in results if p == point}, key=lambda s: (s != peer, s))
        rows += [_row(point, s, results[(s, point)], None if s == peer else base)
                 for s in servers]
    return rows


def goal_tally(rows: list[list]) -> str:
    """"k of n rows meet every goal" over the rows that carry goals."""
    marked = [row[-1] for row in rows if row[-1]]
    return f"{sum('NOT met' not in m for m in marked)} of {len(marked)} rows meet every goal"


def sitting_section(sitting: int, notes: list[str], rows: list[list]) -> str:
    """One sitting as markdown: its notes, the table, the tally of goals."""
    lines = [f"## Sitting {sitting}", "", *(f"- {note}" for note in notes), "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join([*lines, "", goal_tally(rows), ""])


def text_table(rows_by_sitting: dict[int, list[list]]) -> str:
    """Every sitting's rows as one aligned text table (for the terminal)."""
    return format_table(["sitting", *HEADER],
                        [[s, *row] for s, rows in rows_by_sitting.items() for row in rows])


def ratio_series(results: dict[tuple[str, Point], dict], points: list[Point], peer: str,
                 figure: str) -> dict[str, list[float | None]]:
    """Per pdserve set-up, ``figure``'s ratio to ``peer``'s at every point (None where
    either has no result there)."""
    servers = sorted({s for s, _ in results if s != peer})
    series = {}
    for server in servers:
        series[server] = [ratios_of(results[(server, p)], results[(peer, p)])[figure]
                          if (server, p) in results and (peer, p) in results else None
                          for p in points]
    return series


def _cells(points: list[Point]) -> list[tuple[int, int]]:
    """[first, end) index ranges of the runs of ``points`` that share dtype, shape and kind of
    load (closed loop or Poisson)."""
    cells: list[tuple[int, int]] = []
    for i, point in enumerate(points):
        key = (point.dtype, point.shape, point.load.closed)
        if i and key == (points[i - 1].dtype, points[i - 1].shape, points[i - 1].load.closed):
            cells[-1] = (cells[-1][0], i + 1)
        else:
            cells.append((i, i + 1))
    return cells


def write_plot(results: dict[tuple[str, Point], dict], points: list[Point], peer: str,
               path: Path) -> Path:
    """The sitting's PNG: throughput ratio (goal lines 1.3x closed loop, 1.0x Poisson) over
    TPOT P50 ratio (goal line 0.8x), one line per pdserve set-up, x the points in order."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, 0.35 * len(points) + 3), 7),
                                      sharex=True)
    xs, cells = list(range(len(points))), _cells(points)
    colors = plt.get_cmap("tab10").colors
    for axis, figure, lines, label in (
            (top, "output_throughput", (1.3, 1.0), "output throughput / vLLM's"),
            (bottom, "median_tpot_ms", (0.8,), "TPOT P50 / vLLM's")):
        series = ratio_series(results, points, peer, figure)
        for n, (server, ys) in enumerate(series.items()):
            for first, end in cells:  # (a line joins the points of one cell only)
                axis.plot(xs[first:end], [float("nan") if y is None else y
                                          for y in ys[first:end]],
                          marker="o", color=colors[n % len(colors)],
                          label=server if first == 0 else None)
        for line in lines:
            axis.axhline(line, color="gray", linestyle="--", linewidth=0.8)
        for first, _ in cells[1:]:
            axis.axvline(first - 0.5, color="lightgray", linewidth=0.8)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    top.set_title(f"pdserve against {peer}: ratios per point (dashed: the goals, 1.3x closed "
                  "loop, 1.0x Poisson; 0.8x)")
    bottom.set_xticks(xs, [p.label for p in points], rotation=90, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
