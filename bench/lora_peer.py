"""LoRA adapters against vLLM's on this machine: ``python -m pdserve.bench.lora_peer
[--sittings N]``. Prints; never asserts; not part of ``make test``.

The servers, the client and the model are ``pdserve.bench.peer``'s (vLLM's CPU build in its own
venv, SmolLM2-135M fp32, ``vllm bench serve`` as the one client, one server at a time). Each
server starts once per sitting with LoRA on, ``--max-loras 16``, ``--max-lora-rank R`` and the
same 16 PEFT adapters (``pdserve.bench.lora.make_adapters``: rank R on all seven projections)
registered by ``--lora-modules``; then at concurrency ``--concurrency`` the client sends the
base model's name, then spreads the requests at random over 1, 4 and 16 adapter names
(``vllm bench serve --lora-modules``). Reports output tokens per second, TTFT and TPOT per
point with each ratio to vLLM's in the same sitting, and each server's ratio to its own base
point. Where the peer is not installed it says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import zlib
from pathlib import Path

from pdserve.bench import peer
from pdserve.bench.lora import make_adapters
from pdserve.bench.peer_grid import Shape
from pdserve.bench.stats import format_table

POINTS = (("base", 0), ("1 adapter", 1), ("4 adapters", 4), ("16 adapters", 16))


def lora_servers(args, paths: list[Path]) -> list[peer.Server]:
    """vLLM and pdserve's colocated worker with the same adapters registered."""
    flags = ["--enable-lora", "--max-loras", "16", "--max-lora-rank", str(args.rank),
             "--lora-modules", *(f"a{i}={p}" for i, p in enumerate(paths))]
    chosen = [s for s in peer.servers(args.vllm, args.model, args.port)
              if s.name in args.servers]
    return [dataclasses.replace(s, command=[*s.command, *flags]) for s in chosen]


def run(args) -> str:
    paths = make_adapters(Path(args.model), args.adapters_dir / Path(args.model).name, 16,
                          args.rank)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shape, rows = Shape(args.input_len, args.output_len), []
    for sitting in range(1, args.sittings + 1):
        results = {}
        for server in lora_servers(args, paths):
            proc = peer.start(server, args.port, out / f"{server.name}-lora-{sitting}.log")
            try:
                for label, count in POINTS:
                    client = ("--lora-modules", *(f"a{i}" for i in range(count))) if count \
                        else ()
                    requests = peer.workload(args.model, shape, args.num_prompts,
                                             zlib.crc32(f"lora{count}".encode()))
                    results[(server.name, label)] = peer.bench_point(
                        args.vllm, server, args.port, requests, out / str(sitting),
                        f"{server.name}-lora{count}", args.concurrency, None,
                        peer.Lengths.fixed(args.num_prompts, args.output_len), client)
            finally:
                peer.stop(proc)
        for (name, label), res in results.items():
            vllm, own = results.get(("vllm", label)), results[(name, "base")]
            row = [sitting, name, label]
            for figure in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
                value = res[figure]
                versus = f" ({value / vllm[figure]:.2f}x vLLM)" if vllm and name != "vllm" \
                    else ""
                row.append(f"{value:,.1f}{versus} [{value / own[figure]:.2f}x base]")
            rows.append(row)
    return format_table(["sitting", "server", "point", "output tok/s", "TTFT P50 ms",
                         "TPOT P50 ms"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.lora_peer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", default=peer.DEFAULT_VLLM)
    parser.add_argument("--model", default=peer.DEFAULT_MODEL)
    parser.add_argument("--servers", default="vllm,pdserve-colocated")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sittings", type=int, default=1)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--out", default="bench/results/lora-peer")
    parser.add_argument("--adapters-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "pdserve-bench-lora")
    args = parser.parse_args(argv)
    if peer.find_peer(args):
        print(run(args))


if __name__ == "__main__":
    main()
