"""The router's KV index cost: ``python -m pdserve.bench.kv_index [--batches 40] [--repeats 7]``.

Applies the same ``--batches`` event batches (``--stored`` stored and ``--removed`` removed
32-byte hashes each) to a fresh ``KVIndex`` three ways: every stored hash in the pool (a
worker without KV tiers), every one in host memory, and each in a random tier; then matches
2,048 prompts of 64 blocks against each index. Prints, for each, the best of ``--repeats``
runs in microseconds per hash applied and per prompt matched: what a router spends on each
worker's events at each refresh and on each prompt it ranks. Never asserts; not part of
``make test``.
"""

from __future__ import annotations

import argparse
import random
import time

from pdserve.bench.stats import format_table
from pdserve.router.kv_index import KVCapacity, KVIndex
from pdserve.worker_api import KV_TIER_HOST, KV_TIER_NAMES, KVEvents

NUM_PROMPTS, PROMPT_BLOCKS = 2048, 64


def make_batches(args: argparse.Namespace, tiers: str, rng: random.Random) -> list[KVEvents]:
    """The batches over a window that slides through twice the hashes a batch stores."""
    span = 2 * args.batches * args.stored
    hashes = [rng.randbytes(32) for _ in range(span + args.stored + args.removed)]
    batches = []
    for number in range(1, args.batches + 1):
        start = number * args.stored % span
        stored = tuple(hashes[start:start + args.stored])
        removed = tuple(hashes[start + args.stored:start + args.stored + args.removed])
        stored_tiers = {"pool": (), "host": (KV_TIER_HOST,) * len(stored),
                        "mixed": tuple(rng.randrange(len(KV_TIER_NAMES)) for _ in stored)}[tiers]
        batches.append(KVEvents("log", number, stored, removed, stored_tiers))
    return batches


def measure(batches: list[KVEvents], repeats: int) -> tuple[float, float]:
    """(best seconds to apply every batch, best seconds to match every prompt)."""
    capacity = KVCapacity(1 << 30, 1 << 30, 1 << 30)
    prompts = [list(batches[i % len(batches)].stored[:PROMPT_BLOCKS])  # (leading blocks:
               for i in range(NUM_PROMPTS)]  # matched until a later batch removed one)
    best_apply = best_match = float("inf")
    for _ in range(repeats):
        index = KVIndex()
        started = time.perf_counter()
        for events in batches:
            index.apply("w", events, capacity)
        best_apply = min(best_apply, time.perf_counter() - started)
        started = time.perf_counter()
        for prompt in prompts:
            index.matched_tiers("w", prompt)
        best_match = min(best_match, time.perf_counter() - started)
    return best_apply, best_match


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--stored", type=int, default=4096)
    parser.add_argument("--removed", type=int, default=1904)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for tiers in ("pool", "host", "mixed"):
        batches = make_batches(args, tiers, random.Random(0))
        applied, matched = measure(batches, args.repeats)
        num_hashes = sum(len(b.stored) + len(b.removed) for b in batches)
        rows.append([tiers, applied / num_hashes * 1e6, matched / NUM_PROMPTS * 1e6])
    print(format_table(["stored in", "apply us/hash", f"match us/prompt of {PROMPT_BLOCKS}"],
                       rows))


if __name__ == "__main__":
    main()
