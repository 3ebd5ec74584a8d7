"""The benchmark commands of ``pdserve``: ``bench serve`` and ``bench compare`` (load
benchmarks) and ``plan`` (the capacity planner). Like ``cli.main``, importing it loads neither
torch nor ray: ``bench compare`` and ``plan`` import what needs them where they run."""

from __future__ import annotations

import json
import sys

from pdserve.api.client import PdserveError
from pdserve.bench.flags import (
    add_compare_flags,
    add_plan_flags,
    add_serve_flags,
    serve_options,
    shape_from_args,
)
from pdserve.bench.report import (
    dump_json,
    finite,
    format_compare,
    format_measure,
    format_plan,
    format_serve,
)
from pdserve.bench.serve import run_serve
from pdserve.cli.common import add_client_security, admin_security, client_security, fail


def add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="load benchmarks: serve (a running server), compare "
                                         "(disaggregated, auto and colocated)")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,compare}")
    serve = kinds.add_parser("serve", help="send a seeded trace to a running server; vLLM's "
                                           "bench serve result keys plus the phase split")
    add_serve_flags(serve)
    add_client_security(serve, admin=True)  # the admin key reads the server-side phases
    compare = kinds.add_parser("compare", help="disaggregated (1P+1D), auto (1P+1D, conditional "
                                               "disaggregation) and colocated (2 workers) on "
                                               "the embedded cluster at a sweep of rates; JSON "
                                               "and PNG plots")
    add_compare_flags(compare)


def add_plan(sub) -> None:
    plan = sub.add_parser("plan", help="capacity plan from config.json: KV bytes, max batch, "
                                       "roofline step times, binding resource, worker counts")
    add_plan_flags(plan)


def cmd_bench(args) -> int:
    return {"serve": _cmd_bench_serve, "compare": _cmd_bench_compare}[args.bench_command](args)


def _cmd_bench_serve(args) -> int:
    prog = "pdserve bench serve"
    try:
        security = {**client_security(prog, args),
                    "admin_api_key": admin_security(prog, args)["api_key"]}
        options = serve_options(args, security)
        result = run_serve(options)
    except PdserveError as exc:
        fail(prog, f"the server at {args.target} did not serve: {exc.details or exc.code.name}")
    except (OSError, ValueError) as exc:
        fail(prog, str(exc))
    print(format_serve(result))
    if args.save_result:
        dump_json(result, args.save_result)
        print(f"pdserve: result written to {args.save_result}", file=sys.stderr)
    return 0


def _cmd_bench_compare(args) -> int:
    # lazy: starts clusters, so torch and ray (see the module docstring)
    from pdserve.bench.compare import COMPARE_SHAPE, CompareOptions, run_compare

    prog = "pdserve bench compare"
    given = {k: v for k, v in dict(
        rates=args.rates, modes=args.modes, num_prompts=args.num_prompts,
        memory_budget_mib=args.memory_budget_mib,
        max_num_batched_tokens=args.max_num_batched_tokens).items() if v is not None}
    try:
        options = CompareOptions(
            model=args.model, seed=args.seed, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, shape=shape_from_args(args, COMPARE_SHAPE),
            dataset=args.dataset, dataset_path=args.dataset_path,
            goodput=dict(args.goodput or ()), output_dir=args.output_dir,
            disable_tqdm=args.disable_tqdm, from_result=args.from_result, **given)
    except ValueError as exc:
        fail(prog, str(exc))
    if options.from_result is None:
        print(f"pdserve bench compare: {len(options.rates)} rates x {options.num_prompts} "
              f"requests, {', '.join(options.modes)}, interleaved...", flush=True)
    try:
        doc = run_compare(options)
    except (OSError, KeyError, ValueError) as exc:
        if options.from_result is None:
            raise
        fail(prog, f"argument --from-result: cannot read {options.from_result}: {exc}")
    print(format_compare(doc))
    print(f"\nwrote {options.output_dir}/compare.json and " + ", ".join(
        p.rsplit("/", 1)[-1] for p in doc["plots"]))
    if args.save_result:
        dump_json(doc, args.save_result)
    return 0


def cmd_plan(args) -> int:
    # lazy: torch (see the module docstring)
    from pdserve.bench.plan import DEFAULT_MFU, PlanRequest, make_plan
    from pdserve.bench.plan_measure import choose_hardware, measure
    from pdserve.engine.config import EngineConfig
    from pdserve.models import open_checkpoint, tiny_model_dir

    prog = "pdserve plan"
    model = args.model or str(tiny_model_dir())
    margin = args.memory_safety_margin
    if margin is None:  # the seed's arithmetic, or the engine's own margin when measuring
        margin = EngineConfig(model="").memory_safety_margin if args.measure else 0.0
    try:
        mc = open_checkpoint(model).model_config
        reserve = args.activation_reserve_gib
        req = PlanRequest(model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          kv_int8_keep_edge_layers=args.kv_int8_keep_edge_layers,
                          block_size=args.block_size, max_model_len=args.max_model_len,
                          avg_context=args.avg_context,
                          activation_reserve_bytes=None if reserve is None
                          else int(reserve * (1 << 30)), memory_safety_margin=margin,
                          mfu=args.mfu or (1.0 if args.measure else DEFAULT_MFU),
                          tensor_parallel_size=args.tensor_parallel_size,
                          rate=args.rate, isl=args.isl, osl=args.osl)
        device = (args.device or ("cuda" if _has_cuda() else "cpu")).lower()
        if args.measure and device not in ("cpu", "cuda"):
            raise ValueError("--measure profiles this machine: use --device cpu or cuda")
        kind = "cpu" if device == "cpu" else "cuda"  # named accelerators are CUDA devices
        dtype = req.engine_config(kind).resolve_dtype(mc.torch_dtype, _torch_device(kind))
        hw = choose_hardware(args.device, args.hbm_gib, args.hbm_gbps, args.tflops, dtype,
                             measure=args.measure)
        plan = make_plan(req, hw, mc)
    except FileNotFoundError as exc:
        fail(prog, f"argument --model: {exc}")
    except ValueError as exc:
        fail(prog, str(exc))
    measured = measure(req, hw, plan) if args.measure else None
    if args.json:
        print(json.dumps(finite({**plan, **({"measured": measured} if measured else {})}),
                         sort_keys=True))
        return 0
    print(format_plan(plan))
    if measured is not None:
        print("\npredicted against measured on this machine")
        print(format_measure(measured))
    return 0


def _has_cuda() -> bool:
    # lazy: torch (see the module docstring)
    import torch

    return torch.cuda.is_available()


def _torch_device(kind: str):
    # lazy: torch (see the module docstring)
    import torch

    return torch.device(kind)
