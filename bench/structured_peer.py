"""A JSON-schema workload against vLLM on this machine:
``python -m pdserve.bench.structured_peer [--sittings N]``.

The servers, their start and stop are ``pdserve.bench.peer``'s (one at a time, the same model
and cores, interleaved per sitting). The client is this module's, the same for every server:
``--num-prompts`` chat requests, ``--concurrency`` at a time, each streamed with
``response_format`` ``json_schema`` (:data:`SCHEMA`, a record of enums, bounded strings, a
number and a short list, as an extraction pipeline asks), sampled at ``--temperature`` with a
seed per request. Reports per server and concurrency: answers that parse and validate against
the schema (of those sent), output tokens per second over the point's wall time, and the
median TTFT and time per output token (from the usage chunk), with each figure's ratio against
vLLM's in the same sitting. ``--free`` sends the same requests without the schema (their
answers then rarely validate), to tell the grammar's cost from the servers' own gap. Never
asserts; not part of ``make test``. Where the peer is not installed it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import jsonschema

from pdserve.bench import peer
from pdserve.bench.stats import format_table

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "category": {"enum": ["book", "tool", "food", "toy", "other"]},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 3},
    },
    "required": ["name", "category", "price", "in_stock", "tags"],
    "additionalProperties": False,
}
ITEMS = ["a red hammer", "a paperback novel", "a box of apples", "a wooden train",
         "a garden hose", "a jar of honey", "a chess set", "a cookbook"]


def messages(i: int) -> list[dict]:
    item = ITEMS[i % len(ITEMS)]
    return [{"role": "system", "content": "You extract product records as JSON."},
            {"role": "user", "content": f"Record #{i}: the shop sells {item} for "
                                        f"{3 + 7 * i % 90} dollars. Give its record."}]


async def one(client: httpx.AsyncClient, model: str, i: int, args) -> dict:
    body = {"model": model, "messages": messages(i), "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": 1000 + i, "stream": True,
            "stream_options": {"include_usage": True}}
    if not args.free:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "record", "schema": SCHEMA}}
    start, first, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "error": (await response.aread()).decode()[:200]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text.append(piece)
    end = time.perf_counter()
    try:
        jsonschema.validate(json.loads("".join(text)), SCHEMA)
        ok = True
    except (ValueError, jsonschema.ValidationError):
        ok = False
    ttft = (first or end) - start
    return {"ok": ok, "tokens": tokens, "ttft": ttft,
            "tpot": (end - start - ttft) / max(1, tokens - 1)}


async def point(base_url: str, model: str, concurrency: int, args) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def gated(client, i):
        async with gate:
            return await one(client, model, i, args)

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await one(client, model, -1, args)  # warm: the grammar compiled, the path taken once
        start = time.perf_counter()
        results = await asyncio.gather(*(gated(client, i) for i in range(args.num_prompts)))
        wall = time.perf_counter() - start
    done = [r for r in results if "tokens" in r]
    return {"valid": sum(r["ok"] for r in results), "sent": len(results),
            "tok_s": sum(r["tokens"] for r in done) / wall,
            "ttft_ms": 1e3 * statistics.median(r["ttft"] for r in done) if done else None,
            "tpot_ms": 1e3 * statistics.median(r["tpot"] for r in done) if done else None,
            "errors": [r["error"] for r in results if "error" in r][:2]}


def rows_of(figures: dict, sitting: int) -> list[list]:
    """Table rows for one sitting's figures ({(server, concurrency): point()}), each figure
    beside its ratio to vLLM's at the same concurrency."""
    rows = []
    for (name, c), f in figures.items():
        base = figures.get(("vllm", c)) if name != "vllm" else None

        def shown(key, digits, f=f, base=base):
            if f[key] is None:
                return ""
            ratio = f" ({f[key] / base[key]:.2f}x)" if base and base[key] else ""
            return f"{f[key]:.{digits}f}{ratio}"
        rows.append([sitting, name, c, f"{f['valid']}/{f['sent']}", shown("tok_s", 1),
                     shown("ttft_ms", 0), shown("tpot_ms", 1), "; ".join(f["errors"])])
    return rows


def run(args) -> str:
    rows = []
    for sitting in range(1, args.sittings + 1):
        figures = {}
        for server in peer.servers(args.vllm, args.model, args.port):
            if server.name not in args.servers:
                continue
            proc = peer.start(server, args.port, Path(args.out) / f"{server.name}-{sitting}.log")
            try:
                for c in args.concurrency:
                    figures[(server.name, c)] = asyncio.run(point(
                        f"http://127.0.0.1:{args.port}", server.model_name, c, args))
            finally:
                peer.stop(proc)
        rows += rows_of(figures, sitting)
    return format_table(["sitting", "server", "c", "valid", "output tok/s", "TTFT P50 ms",
                         "TPOT P50 ms", "errors"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default=peer.DEFAULT_VLLM)
    parser.add_argument("--model", default=peer.DEFAULT_MODEL)
    parser.add_argument("--servers", default="vllm,pdserve-colocated")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sittings", type=int, default=1)
    parser.add_argument("--free", action="store_true",
                        help="send no response_format: the same requests unconstrained, to "
                             "tell the grammar's cost from the servers' own gap")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--out", default="bench/results/structured-peer")
    args = parser.parse_args(argv)
    if not Path(args.vllm).is_file() or not Path(args.model, "config.json").is_file():
        print(f"the peer is not installed here (no vllm at {args.vllm!r} or no model folder "
              f"{args.model!r}); see pdserve.bench.peer")
        return
    args.servers = args.servers.split(",")
    args.model = str(Path(args.model).resolve())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.out = str(Path(args.out).resolve())
    print(run(args))


if __name__ == "__main__":
    main()
