"""Disaggregation benchmark: ``python -m pdserve.bench.disagg [--quick]``. Prints; never asserts.

In one run, on this machine:
1. KV transfer GB/s through the real channel (a 2-rank gloo pair on loopback, NCCL on GPU):
   the raw channel (one big send/recv), a local memcpy, and the full path (pack, frame, send,
   receive, scatter into blocks) for one request's KV;
2. TTFT of disaggregated (1 prefill + 1 decode, gloo pairs) vs colocated (1 worker) at 128, 1k
   and 4k prompt tokens, with and without layer-wise overlap of sends and compute;
3. streaming overhead per token: the gRPC server and client with a zero-compute backend;
4. shipping a decode step's deltas from a worker to the router (what a worker actor's ``poll``
   returns, pickled as Ray pickles it): one RequestDelta per token against StepDeltas' columns,
   at batch 64 and 256 on the built-in tiny model (its tokenizer makes the text).
Workers run in this process on their own threads (the serving path on CPU uses torch kernels).
Both ends of the loopback channel share this machine's cores with the pack/scatter copies, so
the "transport only" row isolates the framing and channel from those memory passes.
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.api.client import AsyncPdserveClient
from pdserve.bench.engine import write_random_llama
from pdserve.bench.stats import format_table
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.step.detokenizer import Detokenizer
from pdserve.kv_transfer import measure_channel, measure_memcpy, measure_transfer
from pdserve.models import tiny_model_dir
from pdserve.models.checkpoint import open_checkpoint
from pdserve.router.backend import ModelSpec, PreparedRequest, end_stream
from pdserve.router.core import Router
from pdserve.router.directory import StaticDirectory
from pdserve.router.grpc_server import GenerationServer
from pdserve.testing.fake_backend import FakeBackend
from pdserve.worker_api import StepDeltas
from pdserve.worker_api.sampling_params import SamplingParams
from pdserve.workers.build import build_local_workers

MODEL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
             max_position_embeddings=8192)


def transfer_table(quick: bool, rounds: int = 5) -> str:
    """Medians over ``rounds`` interleaved rounds (loopback throughput swings by tens of
    percent from one second to the next on this machine, so every path is sampled alike)."""
    blocks = 64 if quick else 256  # one request: blocks x 16 tokens, 8 layers x 4 heads x 64
    frame = blocks * 16 * 4 * 64 * 4 * 2  # one layer's K and V in fp32: one frame
    total = 8 * frame
    paths = {
        "local memcpy": lambda: measure_memcpy(total, iters=3),
        f"raw channel, one {total >> 20} MiB send/recv": lambda: measure_channel(total, iters=3),
        f"raw channel, one {frame >> 20} MiB frame": lambda: measure_channel(frame, iters=5),
        "KV frames (8 layers), transport only": lambda: measure_transfer(
            num_layers=8, num_blocks=blocks, iters=3, dtype=torch.float32, include_pack=False,
            scatter=False),
        "KV frames (8 layers), no pack, scatter": lambda: measure_transfer(
            num_layers=8, num_blocks=blocks, iters=3, dtype=torch.float32, include_pack=False),
        "KV frames (8 layers) with pack/unpack": lambda: measure_transfer(
            num_layers=8, num_blocks=blocks, iters=3, dtype=torch.float32),
    }
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(1 if quick else rounds):
        for name, measure in paths.items():
            samples[name].append(measure())
    gbps = {name: statistics.median(values) for name, values in samples.items()}
    raw, memcpy = list(gbps.values())[1], list(gbps.values())[0]
    return format_table(["path", "GB/s (median)", "vs raw channel", "vs memcpy"],
                        [[name, v, v / raw, v / memcpy] for name, v in gbps.items()])


async def _ttft(handles, prompt_len: int, repeats: int) -> float:
    router = Router(ModelSpec("bench", 8192, MODEL["vocab_size"]), StaticDirectory(handles),
                    tokenize=list)
    await router.start()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    times = []
    try:
        for i in range(repeats + 1):  # the first run warms up
            prompt = [(7 * i + j) % 4000 + 1 for j in range(prompt_len)]
            start = time.perf_counter()
            stream = router.generate(PreparedRequest(f"b{prompt_len}-{i}", prompt, params,
                                                     params.max_tokens))
            await stream.__anext__()
            if i:
                times.append(time.perf_counter() - start)
            await end_stream(stream)  # closed after the first token: aborted
    finally:
        await router.stop()
    return statistics.median(times)


def ttft_table(model_dir: Path, lengths: list[int], repeats: int) -> str:
    config = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=2048,
                          max_num_batched_tokens=4096, enable_prefix_caching=False)
    setups = {"colocated": dict(colocated=True),
              "disagg, overlap": dict(transport="torch"),
              "disagg, no overlap": dict(transport="torch", prefill_kwargs={"overlap": False})}
    results: dict[str, dict[int, float]] = {}
    for name, kwargs in setups.items():
        handles = build_local_workers(config, **kwargs)
        try:
            results[name] = {n: asyncio.run(_ttft(handles, n, repeats)) for n in lengths}
        finally:
            for h in handles:
                h.close()
    rows = []
    for n in lengths:
        base = results["colocated"][n]
        rows.append([n, base * 1e3] + [x for name in list(setups)[1:]
                                       for x in (results[name][n] * 1e3, results[name][n] / base)])
    return format_table(["prompt tokens", "colocated ms", "disagg overlap ms", "x colocated",
                         "disagg no-overlap ms", "x colocated"], rows)


async def _stream_overhead(num_tokens: int) -> float:
    backend = FakeBackend(ModelSpec("fake", 1 << 20, 64, ()))
    server = GenerationServer(backend)
    port = await server.start("127.0.0.1", 0)
    try:
        async with AsyncPdserveClient(f"127.0.0.1:{port}") as client:
            await client.generate([1, 2], max_tokens=8, ignore_eos=True)
            start = time.perf_counter()
            count = 0
            async for chunk in client.generate_stream([1, 2], max_tokens=num_tokens,
                                                      ignore_eos=True):
                count += len(chunk.token_ids)
            return (time.perf_counter() - start) / count
    finally:
        await server.stop(0)


def _decoding_engine(batch: int) -> LLMEngine:
    """An engine on the built-in tiny model with ``batch`` requests past their first token."""

    engine = LLMEngine(EngineParts.build(EngineConfig(
        model=str(tiny_model_dir()), num_kv_blocks=4096, max_num_seqs=batch,
        max_num_batched_tokens=8192)))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"req-{i}", [(7 * i + j) % 500 + 3 for j in range(20)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_output_tokens == 0 for s in sched.running):
        engine.render(engine.step())
    return engine


def shipping_table(batches: list[int], steps: int) -> str:
    """Per token: the worker's side (render the text, pickle) and the router's (unpickle,
    read each RequestDelta), both encodings on two engines stepped in turn: StepDeltas' own
    (a pure decode step's tokens as columns) and one RequestDelta each."""
    rows = []
    for batch in batches:
        engines = {"RequestDelta each": _decoding_engine(batch),
                   "columns": _decoding_engine(batch)}
        worker = dict.fromkeys(engines, 0.0)
        router, size, tokens = dict(worker), dict(worker), dict(worker)
        for _ in range(steps):
            for name, engine in engines.items():
                deltas = engine.step()
                start = time.perf_counter()
                rendered = engine.render(deltas)
                if name == "RequestDelta each":
                    rendered = StepDeltas(rendered)  # (iterating makes one object per request)
                blob = pickle.dumps(rendered, protocol=5)
                shipped = time.perf_counter()
                tokens[name] += sum(1 for _ in pickle.loads(blob))  # what the router reads
                router[name] += time.perf_counter() - shipped
                worker[name] += shipped - start
                size[name] += len(blob)
        rows += [[batch, name, worker[name] / tokens[name] * 1e6,
                  router[name] / tokens[name] * 1e6, size[name] / tokens[name]]
                 for name in engines]
    return format_table(["batch", "shipped as", "worker us/token", "router us/token",
                         "bytes/token"], rows)


class _PlainDecoder:
    """A tokenizer seen only through ``decode``: the detokenizer's Python path."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def detokenize_line(repeats: int = 5) -> str:
    """Incremental detokenization per token, the DecodeStream path against the Python path,
    on English text and on random ids (what a random-weight model emits: split characters)."""


    tokenizer = open_checkpoint(tiny_model_dir()).tokenizer()
    text = tokenizer.encode("The quick brown fox jumps over the lazy dog, then rests. " * 20)
    rng = random.Random(0)
    noise = [rng.randrange(tokenizer.vocab_size) for _ in range(len(text))]

    def per_token(decoder, ids: list[int]) -> float:
        best = float("inf")
        for _ in range(repeats):
            detok = Detokenizer(decoder, ids[:5])
            start = time.perf_counter()
            for token_id in ids:
                detok.append(token_id)
            best = min(best, (time.perf_counter() - start) / len(ids))
        return best * 1e6

    cells = [f"{per_token(decoder, ids):.2f}" for decoder in (tokenizer, _PlainDecoder(tokenizer))
             for ids in (text, noise)]
    return (f"incremental detokenization, us per token (text / random ids): DecodeStream "
            f"{cells[0]} / {cells[1]}, Python decodes {cells[2]} / {cells[3]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args(argv)
    print("1. KV transfer bandwidth")
    print(transfer_table(args.quick))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_llama(Path(tmp) / "llama", **MODEL)
        lengths = [128, 512] if args.quick else [128, 1024, 4096]
        print(f"\n2. TTFT, disaggregated vs colocated (random Llama, {MODEL['num_hidden_layers']}"
              f" layers, hidden {MODEL['hidden_size']}, fp32)")
        print(ttft_table(model_dir, lengths, 1 if args.quick else 3))
    per_token = asyncio.run(_stream_overhead(200 if args.quick else 2000))
    print(f"\n3. streaming overhead through gRPC (zero-compute backend): "
          f"{per_token * 1e6:.0f} us per token")
    print("\n4. a decode step's deltas from worker to router (tiny model)")
    print(detokenize_line())
    print(shipping_table([16, 64] if args.quick else [64, 256], 8 if args.quick else 64))


if __name__ == "__main__":
    main()
