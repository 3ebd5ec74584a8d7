"""``pdserve bench compare``: disaggregated (1 prefill + 1 decode, every prompt on the
prefill worker), auto (the same two workers, conditional disaggregation: a short prompt may be
prefilled on the decode worker) and colocated (2 workers) on the same machine, the same model,
the same seeded trace, at a sweep of rates.

1. Start the modes' embedded clusters (two workers each) in one Ray, warm each up, then for
   each rate run ``pdserve bench serve`` (:mod:`pdserve.bench.serve`) on one after the other
   (the order reversing per rate, so the machine's noise hits every mode alike): the same
   prompts and output lengths each time, arrivals of the same seeded gamma process scaled to
   the rate. Only one cluster has traffic at a time; the idle one's workers sleep.
2. SLOs: the ``goodput`` given, else derived after the sweep from the lowest rate (nearly
   unloaded): TTFT SLO = 3 x the better mode's median TTFT there, TPOT SLO = 2 x its median
   TPOT. Each request is good when it meets both; attainment = good / sent.
3. Report per mode the highest swept rate whose attainment is >= 90 % and its ratio to
   colocated's, and write ``compare.json`` and the plots
   (:mod:`pdserve.bench.plots`) into the output folder. ``from_result`` re-scores a saved
   ``compare.json`` (other SLOs) and redraws its plots without running anything.

The default workload makes prefill interference real: long prompts (mean 768 tokens) beside
long outputs (mean 128) on a random Llama big enough that a prompt chunk costs many decode
steps (hidden 256, 4 layers: ~80 ms per 512-token chunk against ~2.5 ms per decode step on
one CPU core). With colocated
workers each prompt chunk stalls every running decode on that worker; disaggregated, decode
steps never wait for a prompt. Each worker runs on one torch thread, so on a 2-core machine
the two workers of either mode get about a core each, and the router and this client take
their share from the same two.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.bench.plots import write_plots
from pdserve.bench.report import dump_json
from pdserve.bench.serve import ServeOptions, compute_metrics, run_serve
from pdserve.bench.workload import RequestOutcome, SyntheticShape
from pdserve.cluster.launcher import EmbeddedCluster
from pdserve.cluster.options import ClusterOptions
from pdserve.models import ModelConfig, tiny_model_dir
from pdserve.models.config import hf_tensor_shapes
from pdserve.models.tiny import TINY_CONFIG
from pdserve.router.core import RouterConfig

logger = logging.getLogger(__name__)

MODES = ("disaggregated", "auto", "colocated")
DISAGGREGATION = {"disaggregated": "always", "auto": "auto"}  # RouterConfig.disaggregation
ATTAINMENT = 0.9  # the headline: the highest rate at >= 90 % SLO attainment
TTFT_SLO_SCALE = 3.0  # derived SLOs: these many times the lowest rate's median
TPOT_SLO_SCALE = 2.0  # (token pacing is what colocated prefill chunks disturb)
COMPARE_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                     max_position_embeddings=4096)
COMPARE_SHAPE = SyntheticShape(input_mean=768, output_mean=128, sigma=0.6, min_output=16)


@dataclass
class CompareOptions:
    """What ``pdserve bench compare`` is asked for."""

    model: str | None = None  # None: a random Llama of COMPARE_MODEL written for the run
    modes: tuple[str, ...] = MODES  # which of MODES to run
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0, 4.0)  # requests/s
    num_prompts: int = 16  # per rate
    seed: int = 0
    burstiness: float = 1.0
    max_concurrency: int | None = None
    shape: SyntheticShape = field(default_factory=lambda: COMPARE_SHAPE)
    dataset: str = "synthetic"
    dataset_path: str | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # empty: derived (docstring, 2.)
    memory_budget_mib: int = 512
    max_num_batched_tokens: int = 512
    output_dir: str = "pdserve-compare"
    disable_tqdm: bool = True
    from_result: str | None = None  # a compare.json to re-score and re-plot instead of running

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError("rates must be a non-empty list of numbers > 0")
        self.rates = tuple(sorted(self.rates))
        unknown = set(self.modes) - set(MODES)
        if not self.modes or unknown:
            raise ValueError(f"modes must be a non-empty list of {', '.join(MODES)}, "
                             f"got {', '.join(self.modes)}")
        self.modes = tuple(m for m in MODES if m in self.modes)


def write_random_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama checkpoint (safetensors, config.json, the built-in tokenizer) without
    transformers: weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1)."""



    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, "head_dim": None, **COMPARE_MODEL, **overrides}
    config = {k: v for k, v in config.items() if v is not None}
    mc = ModelConfig.from_dict(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(hf_tensor_shapes(mc).items()):
        noise = torch.randn(shape, generator=gen)
        tensors[name] = (noise / shape[1] ** 0.5 if len(shape) == 2 else 1 + 0.1 * noise)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir() / name, path / name)
    return path


def cluster_options(mode: str, model: str, opts: CompareOptions):
    # No prefix cache: every rate replays the same prompts, which would otherwise be cached
    # after the first rate and cost no prefill at all.
    engine = dict(dtype="float32", memory_budget_bytes=opts.memory_budget_mib << 20,
                  max_num_batched_tokens=opts.max_num_batched_tokens,
                  enable_prefix_caching=False)
    shape = (dict(colocated=True, num_decode=2) if mode == "colocated"
             else dict(num_prefill=1, num_decode=1))
    router = RouterConfig(stats_interval_s=0.25,
                          disaggregation=DISAGGREGATION.get(mode, "always"))
    # worker_cpus=0: the clusters share one Ray whose CPUs would otherwise all go to the
    # first; every worker still runs one torch thread.
    return ClusterOptions(model=model, port=0, metrics_port=None, engine=engine,
                          router=router, worker_cpus=0, **shape)


def serve_options(target: str, opts: CompareOptions, rate: float, num_prompts: int,
                  progress_desc: str = "requests") -> ServeOptions:
    return ServeOptions(target=target, wait_ready_s=60, num_prompts=num_prompts,
                        request_rate=rate, burstiness=opts.burstiness,
                        max_concurrency=opts.max_concurrency, seed=opts.seed,
                        dataset=opts.dataset, dataset_path=opts.dataset_path, shape=opts.shape,
                        disable_tqdm=opts.disable_tqdm, progress_desc=progress_desc)


def run_modes(model: str, opts: CompareOptions) -> dict[str, dict[float, dict]]:
    """mode -> rate -> the bench serve result (step 1): every mode's cluster up at once, the
    rates interleaved (the modes' order reverses per rate), so the machine's noise hits every
    mode alike."""
    modes = opts.modes
    runs: dict[str, dict[float, dict]] = {mode: {} for mode in modes}
    with contextlib.ExitStack() as stack:
        clusters = {}
        for mode in modes:  # the first starts Ray (and stops it last), the others join it
            cluster = EmbeddedCluster(cluster_options(mode, model, opts))
            stack.callback(cluster.stop)
            cluster.start()
            cluster.wait_ready(120)
            clusters[mode] = cluster
            run_serve(replace(serve_options(cluster.target, opts, math.inf, 2,
                                            f"{mode} warm-up"), seed=opts.seed + 1))
        for i, rate in enumerate(opts.rates):
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                logger.info("%s: rate %g req/s", mode, rate)
                runs[mode][rate] = run_serve(serve_options(
                    clusters[mode].target, opts, rate, opts.num_prompts, f"{mode} {rate:g} req/s"))
    return runs


def outcomes_of(result: dict) -> list[RequestOutcome]:
    """The per-request outcomes a result document keeps (for re-scoring against SLOs)."""
    return [RequestOutcome(f"r{i}", n_in, n_out, ttft, itl, e2el, start, not err, err)
            for i, (n_in, n_out, ttft, itl, e2el, start, err) in enumerate(zip(
                result["input_lens"], result["output_lens"], result["ttfts"], result["itls"],
                result["e2els"], result["start_times"], result["errors"], strict=True))]


def derive_slos(runs: dict[str, dict[float, dict]]) -> dict[str, float]:
    """Step 2: the scales x the better mode's medians at the lowest rate (ms)."""
    lowest = min(next(iter(runs.values())))
    return {"ttft": TTFT_SLO_SCALE * min(r[lowest]["median_ttft_ms"] for r in runs.values()),
            "tpot": TPOT_SLO_SCALE * min(r[lowest]["median_tpot_ms"] for r in runs.values())}


def score(runs: dict[str, dict[float, dict]], slos: dict[str, float]) -> dict:
    """Per mode and rate: P99 TTFT/TPOT, goodput and attainment against ``slos``; the
    highest rate at >= ATTAINMENT per mode and each mode's ratio to colocated's (step 3:
    ``ratio`` is disaggregated's)."""
    table: dict[str, dict[float, dict]] = {}
    for mode, by_rate in runs.items():
        table[mode] = {}
        for rate, result in by_rate.items():
            scored = compute_metrics(outcomes_of(result), result["duration"], slos)
            table[mode][rate] = {
                "p99_ttft_ms": result["p99_ttft_ms"], "p99_tpot_ms": result["p99_tpot_ms"],
                "p99_itl_ms": result["p99_itl_ms"],
                "median_ttft_ms": result["median_ttft_ms"],
                "median_tpot_ms": result["median_tpot_ms"],
                "request_throughput": result["request_throughput"],
                "request_goodput": scored["request_goodput"],
                "slo_attainment": scored["slo_attainment"], "failed": result["failed"],
                "phases": result.get("phases")}
    best = {mode: max((r for r, row in rows.items() if row["slo_attainment"] >= ATTAINMENT),
                      default=None) for mode, rows in table.items()}
    c = best.get("colocated")
    ratios = {mode: (rate / c if rate is not None and c else None)
              for mode, rate in best.items() if mode != "colocated"}
    return {"table": table, "best_rate": best, "ratios": ratios,
            "ratio": ratios.get("disaggregated")}


def load_runs(path: str) -> dict[str, dict[float, dict]]:
    """The per-mode, per-rate results of a saved compare.json."""

    doc = json.loads(Path(path).read_text())
    return {mode: {float(rate): result for rate, result in doc["runs"][mode].items()}
            for mode in MODES if mode in doc["runs"]}


def _run_fresh(opts: CompareOptions) -> dict[str, dict[float, dict]]:
    tmp = None
    model = opts.model
    if model is None:
        tmp = tempfile.mkdtemp(prefix="pdserve-compare-")
        model = str(write_random_llama(Path(tmp) / "llama", opts.seed))
    try:
        return run_modes(model, opts)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run_compare(opts: CompareOptions) -> dict:
    """Steps 1-3; returns the compare document (also written to ``output_dir``)."""

    if opts.from_result:
        runs = load_runs(opts.from_result)
    else:
        runs = _run_fresh(opts)
    slos = dict(opts.goodput) or derive_slos(runs)
    scored = score(runs, slos)
    doc = {"options": {**asdict(opts), "model": opts.model or f"random Llama {COMPARE_MODEL}"},
           "slos_ms": slos, "slos_derived": not opts.goodput, "attainment_target": ATTAINMENT,
           **scored, "runs": {mode: {str(r): res for r, res in by_rate.items()}
                              for mode, by_rate in runs.items()}}
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_json(doc, str(out / "compare.json"))
    doc["plots"] = [str(p) for p in write_plots(doc, out)]
    return doc
