"""Flags of ``pdserve bench serve``, ``pdserve bench compare`` and ``pdserve plan``, and the
option objects they build (the commands themselves live in ``pdserve.cli.main``)."""

from __future__ import annotations

import argparse
import math

from pdserve.bench.serve import GOODPUT_METRICS, METRICS, ServeOptions
from pdserve.bench.workload import DATASETS, SyntheticShape

GiB = 1 << 30


def goodput_slo(text: str) -> tuple[str, float]:
    """``ttft:500`` -> ("ttft", 500.0)."""
    name, sep, value = text.partition(":")
    if not sep or name not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS with METRIC one of "
                                         f"{', '.join(GOODPUT_METRICS)}, got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of ms: {text!r}") from None
    if not ms > 0:
        raise argparse.ArgumentTypeError(f"an SLO must be > 0 ms: {text!r}")
    return name, ms


def _metric_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(METRICS)}")
    return names


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None


def add_workload_flags(parser) -> None:
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests to send (default: 200; compare: 16 per rate)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and arrivals")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps between arrivals (1 = Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most (default: no limit)")
    parser.add_argument("--dataset", choices=DATASETS, default="synthetic",
                        help="synthetic: random prompts; prefix: conversations over shared "
                             "system prompts, resending their history; jsonl: --dataset-path")
    parser.add_argument("--dataset-path", default=None, metavar="FILE",
                        help='jsonl: one {"prompt": ...} or {"prompt_len": N} per line, with an '
                             'optional "output_len"')
    parser.add_argument("--input-mean", type=float, default=None,
                        help="synthetic: mean prompt tokens (log-normal)")
    parser.add_argument("--output-mean", type=float, default=None,
                        help="synthetic: mean output tokens (log-normal)")
    parser.add_argument("--length-sigma", type=float, default=None,
                        help="synthetic: log-normal shape of both lengths (default 0.8)")
    parser.add_argument("--goodput", nargs="+", type=goodput_slo, default=None,
                        metavar="METRIC:MS", help="SLOs a good request meets, e.g. "
                                                  "ttft:500 tpot:50 (ttft, tpot, e2el)")
    parser.add_argument("--percentile-metrics", type=_metric_list, default=METRICS,
                        help="comma list of ttft,tpot,itl,e2el (default all)")
    parser.add_argument("--metric-percentiles", type=_float_list, default=(50.0, 90.0, 99.0),
                        help="comma list of percentiles (default 50,90,99)")
    parser.add_argument("--save-result", default=None, metavar="FILE.json",
                        help="write the result document here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_flags(parser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051",
                        help="server gRPC HOST:PORT, or a comma list of one cluster's routers "
                             "(request i goes to router i mod n)")
    parser.add_argument("--base-url", default=None, metavar="URL",
                        help="send the traffic to the OpenAI HTTP API here (e.g. "
                             "http://127.0.0.1:8000); --target still gives the model info and "
                             "the Admin reports")
    parser.add_argument("--wait-ready-s", type=float, default=0.0, metavar="S",
                        help="wait this long for the server to be SERVING")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second (default inf: all at once)")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline per request (s)")
    add_workload_flags(parser)


def shape_from_args(args, base: SyntheticShape = SyntheticShape()) -> SyntheticShape:
    return SyntheticShape(args.input_mean or base.input_mean,
                          args.output_mean or base.output_mean,
                          args.length_sigma or base.sigma)


def serve_options(args, security: dict) -> ServeOptions:
    """ValueError naming the field for a bad combination."""
    return ServeOptions(
        target=args.target, base_url=args.base_url, wait_ready_s=args.wait_ready_s,
        num_prompts=args.num_prompts or 200, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        dataset=args.dataset, dataset_path=args.dataset_path, shape=shape_from_args(args),
        goodput=dict(args.goodput or ()), percentile_metrics=args.percentile_metrics,
        metric_percentiles=args.metric_percentiles, timeout_s=args.timeout,
        disable_tqdm=args.disable_tqdm, **security)


def add_compare_flags(parser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: a random "
                                                      "Llama written for the run, see --help)")
    parser.add_argument("--rates", type=_float_list, default=None,
                        help="comma list of request rates to sweep (req/s)")
    parser.add_argument("--modes", type=lambda text: tuple(text.split(",")), default=None,
                        help="comma list of the modes to run: disaggregated (1P+1D, every "
                             "prompt on the prefill worker), auto (1P+1D, conditional "
                             "disaggregation), colocated (2 workers); default all three")
    parser.add_argument("--output-dir", default="pdserve-compare", metavar="DIR",
                        help="where compare.json and the PNG plots go")
    parser.add_argument("--memory-budget-mib", type=int, default=None,
                        help="per worker (default 512)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step (default 512: prefill chunks interleave)")
    parser.add_argument("--from-result", default=None, metavar="COMPARE.json",
                        help="re-score a saved compare.json (e.g. with other --goodput SLOs) "
                             "and redraw its plots, running nothing")
    add_workload_flags(parser)


def add_plan_flags(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint folder; config.json is enough (default: the built-in "
                             "tiny model)")
    hw = parser.add_argument_group("hardware (default: this machine, measured now)")
    hw.add_argument("--device", default=None,
                    help="an accelerator by name (H200, H100, A100-80GB, A100-40GB, L40S, "
                         "A10G), or cpu / cuda for this machine measured")
    hw.add_argument("--hbm-gib", type=float, default=None, help="device memory (GiB)")
    hw.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth (GB/s)")
    hw.add_argument("--tflops", type=float, default=None, help="dense peak (TFLOPS)")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights and KV (auto: as the engine picks on the device)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"))
    parser.add_argument("--kv-int8-keep-edge-layers", action=argparse.BooleanOptionalAction,
                        default=None, help="with int8: first and last layers in the model "
                                           "dtype (default: as the engine)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--avg-context", type=int, default=None,
                        help="tokens per running request (default: isl + osl/2, else 4096)")
    parser.add_argument("--activation-reserve-gib", type=float, default=None,
                        help="default: the engine's own activation estimate")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--memory-safety-margin", type=float, default=None,
                        help="fraction of memory kept free (default 0, the seed's arithmetic; "
                             "the engine keeps 0.05; --measure uses the engine's)")
    parser.add_argument("--mfu", type=float, default=None,
                        help="fraction of peak FLOPs prefill reaches (default 0.5; 1.0 with "
                             "--measure, whose peak is this machine's measured matmul rate)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="devices per worker, each holding 1/N of every layer (default 1)")
    parser.add_argument("--rate", type=float, default=None, help="requests/s to plan for")
    parser.add_argument("--isl", type=int, default=None, help="input tokens per request")
    parser.add_argument("--osl", type=int, default=None, help="output tokens per request")
    parser.add_argument("--measure", action="store_true",
                        help="also run the engine here and print predicted against measured")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
