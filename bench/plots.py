"""The PNG plots of ``pdserve bench compare`` (matplotlib, Agg backend: no display needed).

From a compare document (:func:`pdserve.bench.compare.run_compare`):

* ``p99_ttft_vs_rate.png``, ``p99_tpot_vs_rate.png``: one line per mode;
* ``goodput_vs_rate.png``: goodput (requests/s meeting every SLO) per mode, and SLO attainment
  with the 90 % line below it;
* ``phases.png``: per rate, one stacked bar per mode of the mean time per request in each
  phase (queue, prefill, transfer, router, decode; router traces).
"""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.phases import PHASES

_STYLE = {"disaggregated": dict(color="tab:blue", marker="o"),
          "colocated": dict(color="tab:orange", marker="s"),
          "auto": dict(color="tab:green", marker="^")}


def pyplot():
    """matplotlib's pyplot on the Agg backend (for the bench modules that plot)."""
    # lazy: plots only when asked; matplotlib takes a second to import
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: never a display
    # lazy: plots only when asked; matplotlib takes a second to import
    import matplotlib.pyplot as plt

    return plt


def _series(doc: dict, mode: str, key: str) -> tuple[list[float], list[float]]:
    rows = doc["table"][mode]
    rates = sorted(rows, key=float)
    return [float(r) for r in rates], [rows[r][key] for r in rates]


def _line_plot(doc: dict, key: str, ylabel: str, title: str, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in doc["table"]:
        ax.plot(*_series(doc, mode, key), label=mode, **_STYLE.get(mode, {}))
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _goodput_plot(doc: dict, path: Path) -> Path:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for mode in doc["table"]:
        style = _STYLE.get(mode, {})
        top.plot(*_series(doc, mode, "request_goodput"), label=mode, **style)
        rates, attain = _series(doc, mode, "slo_attainment")
        bottom.plot(rates, [100 * a for a in attain], label=mode, **style)
    slos = ", ".join(f"{k} <= {v:.0f} ms" for k, v in doc["slos_ms"].items())
    top.set_title(f"goodput (requests meeting {slos})")
    top.set_ylabel("goodput (req/s)")
    target = 100 * doc.get("attainment_target", 0.9)
    bottom.axhline(target, color="gray", linestyle="--", label=f"{target:.0f} % attainment")
    bottom.set_ylabel("SLO attainment (%)")
    bottom.set_xlabel("request rate (req/s)")
    bottom.set_ylim(0, 105)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _phase_plot(doc: dict, path: Path) -> Path:
    plt = pyplot()
    modes = list(doc["table"])
    rates = sorted({r for m in modes for r in doc["table"][m]}, key=float)
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(rates) + 1.5), 4))
    width = 0.8 / max(1, len(modes))
    colors = plt.get_cmap("tab10").colors
    for m, mode in enumerate(modes):
        bottoms = [0.0] * len(rates)
        for p, phase in enumerate(PHASES):
            heights = []
            for r in rates:
                phases = doc["table"][mode].get(r, {}).get("phases") or {}
                heights.append(phases.get(phase, {}).get("mean_ms", 0.0))
            xs = [i + (m - (len(modes) - 1) / 2) * width for i in range(len(rates))]
            ax.bar(xs, heights, width * 0.95, bottom=bottoms, color=colors[p % len(colors)],
                   hatch="" if m == 0 else "//", edgecolor="white",
                   label=phase if m == 0 else None)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(range(len(rates)), [f"{float(r):g} req/s" for r in rates])
    ax.set_ylabel("mean time per request (ms)")
    ax.set_title(" | ".join(f"{mode}{' (hatched)' if m else ''}"
                            for m, mode in enumerate(modes)) + ": where the time went")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(doc: dict, out_dir: str | Path) -> list[Path]:
    """Write the four plots of the module docstring into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [_line_plot(doc, "p99_ttft_ms", "P99 TTFT (ms)", "P99 time to first token",
                       out / "p99_ttft_vs_rate.png"),
            _line_plot(doc, "p99_tpot_ms", "P99 TPOT (ms)", "P99 time per output token",
                       out / "p99_tpot_vs_rate.png"),
            _goodput_plot(doc, out / "goodput_vs_rate.png"),
            _phase_plot(doc, out / "phases.png")]
