"""KV tiers against recomputing: ``python -m pdserve.bench.kv_tiers [--quick] [--model DIR]``.
Prints; never asserts; not part of ``make test``.

On SmolLM2-135M (fp32, the peer's checkpoint: ``../shared/peer`` sets it up in
``/tmp/peer-model/smollm2-hf``; ``--quick`` or a missing checkpoint: the built-in tiny model
and a small workload), one offline engine per case runs a seeded multi-turn workload of token
ids: ``--conversations`` conversations, each opening with one of ``--system-prompts`` shared
system prompts (``--system-len`` tokens); at each of ``--turns`` turns a conversation appends
a user message (``--user-len`` tokens, drawn uniformly) to its history and sends it all; the
model answers ``--output-len`` greedy tokens (ignore_eos), and the answer joins the history.
Every turn sends each conversation once, in a seeded shuffle, ``--max-num-seqs`` prompts at a
time (one ``generate`` call each), so a conversation comes back only after every other one
has been served. The pool (``num_kv_blocks``) holds ``--max-num-seqs`` of the longest
histories the lengths allow, and one block more; there are as many conversations as it takes
(at least ``--conversations``) for their histories after the last turn (the working set,
each system prompt counted once) to be ``--working-set-ratio`` times the pool.

Cases, all on the same prompts:

* ``no tiers``: the prefix cache in the pool alone; evicted histories are recomputed;
* ``host``: a host tier holding the whole working set;
* ``host small + disk``: a host tier of a quarter of the working set over a disk tier (a
  private folder under ``--disk-dir``, on the local disk) holding all of it;
* ``host small, int8``: a host tier of a third of the working set's float32 bytes, storing
  blocks as int8 (``kv_offload_int8``: about a quarter of their bytes, so it holds them all);
* ``no reuse, ...``: prompts of the same lengths, sent in the same order, of distinct random
  tokens (nothing to reuse), without tiers and with ``host small + disk``: what saving every
  evicted block costs when nothing comes back.

Per case: TTFT P50 and P99 over the requests (first token time less arrival, the arrival
being the ``generate`` call that sent it), TTFT P50 of the turns whose prompt passes
``--long-history`` tokens, output tokens per second of wall time, each ratio to the case
without tiers of the same workload in the same run; then the prompt tokens served from each
tier (the block manager's ``num_prefix_hit_tokens``, of which ``num_tier_hit_tokens`` came
from the host and disk tiers) over all prompt tokens, and each tier's read rate (the tiers'
``read_bytes / read_s``: a read, its checks and, from disk, the file) next to what a plain
copy of a block gives on this machine: a numpy copy in memory, a file of the same size read
back from the disk tier's folder after writing it, and zlib's CRC-32 of a block (what every
read also computes). ``--cases`` runs some of the cases, in the order given (a case's
ratios need its workload's case without tiers in the same run); ``--threads`` sets torch's
threads (on a machine other processes share, one thread each keeps them from waiting on each
other).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from pdserve.bench.stats import format_table, percentile
from pdserve.bench.workload import random_ids
from pdserve.engine.llm import LLM, RequestOutput
from pdserve.models.config import ModelConfig
from pdserve.models.tiny import tiny_model_dir
from pdserve.worker_api import KV_TIER_DISK, KV_TIER_HOST
from pdserve.worker_api.sampling_params import SamplingParams

PEER_MODEL = Path("/tmp/peer-model/smollm2-hf")
GIB = 1 << 30
NO_TIERS, HOST, HOST_DISK = "no tiers", "host", "host small + disk"
HOST_INT8 = "host small, int8"
NO_REUSE = "no reuse, "
CASES = (NO_TIERS, HOST, HOST_DISK, HOST_INT8, NO_REUSE + NO_TIERS, NO_REUSE + HOST_DISK)


@dataclasses.dataclass(frozen=True)
class Conversations:
    """A seeded multi-turn workload (the module docstring): everything but the answers,
    which the model writes."""

    system_prompts: list[list[int]]  # the shared system prompts
    system_of: list[int]  # per conversation: the index of its system prompt
    user_messages: list[list[list[int]]]  # per conversation, per turn: the message's ids
    orders: list[list[int]]  # per turn: the conversations in the order they are sent
    output_len: int  # tokens each answer has

    @property
    def num_turns(self) -> int:
        return len(self.orders)

    def prompt_len(self, conversation: int, turn: int) -> int:
        """Tokens conversation ``conversation`` sends at ``turn`` (its history, then the new
        message): known before the answers, which all have ``output_len`` tokens."""
        messages = self.user_messages[conversation]
        return (len(self.system_prompts[self.system_of[conversation]])
                + sum(len(m) for m in messages[:turn]) + turn * self.output_len
                + len(messages[turn]))


def make_conversations(num_conversations: int, num_turns: int, num_system_prompts: int,
                       system_len: int, user_len: tuple[int, int], output_len: int,
                       vocab_size: int, seed: int) -> Conversations:
    rng = random.Random(seed)
    systems = [random_ids(rng, system_len, vocab_size) for _ in range(num_system_prompts)]
    messages = [[random_ids(rng, rng.randint(*user_len), vocab_size) for _ in range(num_turns)]
                for _ in range(num_conversations)]
    orders = [rng.sample(range(num_conversations), num_conversations) for _ in range(num_turns)]
    return Conversations(systems, [c % num_system_prompts for c in range(num_conversations)],
                         messages, orders, output_len)


def batches(conv: Conversations, batch_size: int) -> list[tuple[int, list[int]]]:
    """(turn, conversations) of every ``generate`` call, in sending order."""
    return [(turn, order[i:i + batch_size]) for turn, order in enumerate(conv.orders)
            for i in range(0, len(order), batch_size)]


def run_multi_turn(llm: LLM, conv: Conversations, batch_size: int, bar
                   ) -> list[tuple[int, RequestOutput]]:
    """Every turn of ``conv`` with the model's answers joining the histories: (prompt
    tokens, output) of each request."""
    histories = [list(conv.system_prompts[s]) for s in conv.system_of]
    params = SamplingParams(max_tokens=conv.output_len, temperature=0.0, ignore_eos=True)
    results = []
    for turn, group in batches(conv, batch_size):
        prompts = [histories[c] + conv.user_messages[c][turn] for c in group]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for c, prompt, out in zip(group, prompts, outs, strict=True):
            histories[c] = prompt + out.token_ids
            results.append((len(prompt), out))
        bar.update(len(group))
    return results


def run_no_reuse(llm: LLM, conv: Conversations, batch_size: int, vocab_size: int, seed: int,
                 bar) -> list[tuple[int, RequestOutput]]:
    """The same calls with prompts of the same lengths, each of fresh random ids."""
    rng = random.Random(seed + 1)
    params = SamplingParams(max_tokens=conv.output_len, temperature=0.0, ignore_eos=True)
    results = []
    for turn, group in batches(conv, batch_size):
        prompts = [random_ids(rng, conv.prompt_len(c, turn), vocab_size) for c in group]
        outs = llm.generate(prompts, params, use_tqdm=False)
        results += [(len(p), out) for p, out in zip(prompts, outs, strict=True)]
        bar.update(len(group))
    return results


@dataclasses.dataclass
class CaseResult:
    """What one case measured."""

    ttft_s: list[float]  # per request
    long_ttft_s: list[float]  # per request whose prompt passed --long-history tokens
    output_tok_s: float  # output tokens per second of wall time
    prompt_tokens: int  # every prompt token the block manager looked up
    pool_hit_tokens: int  # served from the pool's prefix cache
    tier_hit_tokens: dict[int, int]  # loaded from each tier below the pool
    read_bytes_per_s: dict[int, float | None]  # each tier's measured read rate (None: no read)


def run_case(model: Path, conv: Conversations, label: str, reuse: bool, tiers: dict,
             args) -> CaseResult:
    """One engine with ``tiers`` (its kv_offload_* settings), the whole workload on it
    (``reuse``: multi-turn, else no reuse)."""
    with LLM(str(model), dtype="float32", block_size=args.block_size,
             num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs, **tiers) as llm:
        bm = llm.engine.parts.block_manager
        warm_up = random_ids(random.Random("warm-up"), 4 * args.block_size, args.vocab_size)
        llm.generate([warm_up], SamplingParams(max_tokens=2), use_tqdm=False)
        queried, hits = bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens
        total = sum(len(group) for _, group in batches(conv, args.max_num_seqs))
        with tqdm(total=total, desc=label, unit="req") as bar:
            start = time.perf_counter()
            if reuse:
                results = run_multi_turn(llm, conv, args.max_num_seqs, bar)
            else:
                results = run_no_reuse(llm, conv, args.max_num_seqs, args.vocab_size,
                                       args.seed, bar)
            wall = time.perf_counter() - start
        tier_hits = dict(bm.num_tier_hit_tokens)
        offload = bm.offload
        rates: dict[int, float | None] = {KV_TIER_HOST: None, KV_TIER_DISK: None}
        if offload is not None:
            c = offload.tiers.counters
            for tier, (nbytes, seconds) in ((KV_TIER_HOST, (c.host_read_bytes, c.host_read_s)),
                                            (KV_TIER_DISK, (c.disk_read_bytes, c.disk_read_s))):
                rates[tier] = nbytes / seconds if seconds > 0 else None
        return CaseResult(
            ttft_s=[out.ttft_s for _, out in results],
            long_ttft_s=[out.ttft_s for n, out in results if n > args.long_history],
            output_tok_s=sum(len(out.token_ids) for _, out in results) / wall,
            prompt_tokens=bm.num_prefix_query_tokens - queried,
            pool_hit_tokens=bm.num_prefix_hit_tokens - hits - sum(tier_hits.values()),
            tier_hit_tokens=tier_hits, read_bytes_per_s=rates)


def plain_copy_rates(nbytes: int, folder: Path, repeats: int = 64) -> dict[str, float]:
    """Bytes per second of a plain copy of one block on this machine: a numpy copy in memory,
    files of that size read back from ``folder`` right after writing them, zlib's CRC-32."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    start = time.perf_counter()
    for _ in range(repeats):
        np.copyto(dst, src)
    memory = repeats * nbytes / (time.perf_counter() - start)
    paths = [folder / f"plain-{i}" for i in range(repeats)]
    for path in paths:
        path.write_bytes(memoryview(src))
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb") as f:
            f.readinto(memoryview(dst))
    disk = repeats * nbytes / (time.perf_counter() - start)
    for path in paths:
        path.unlink()
    start = time.perf_counter()
    for _ in range(repeats):
        zlib.crc32(src)
    crc = repeats * nbytes / (time.perf_counter() - start)
    return {"memory copy": memory, "file read": disk, "CRC-32": crc}


def size_workload(args) -> Conversations:
    """The pool for ``--max-num-seqs`` of the longest histories there can be, and enough
    conversations that their histories after the last turn are ``--working-set-ratio`` times
    it (sets ``args.num_kv_blocks`` and ``args.conversations``)."""
    low, high = args.user_len
    longest = args.system_len + args.turns * (high + args.output_len)
    args.num_kv_blocks = args.max_num_seqs * -(-longest // args.block_size) + 1
    each = args.turns * ((low + high) / 2 + args.output_len)  # a history past its system prompt
    needed = math.ceil((args.working_set_ratio * args.num_kv_blocks * args.block_size
                        - args.system_prompts * args.system_len) / each)
    args.conversations = max(args.conversations or 0, needed, args.max_num_seqs)
    return make_conversations(args.conversations, args.turns, args.system_prompts,
                              args.system_len, tuple(args.user_len), args.output_len,
                              args.vocab_size, args.seed)


def working_set_tokens(conv: Conversations) -> int:
    """Distinct tokens of the histories after the last turn (a shared system prompt once)."""
    last = conv.num_turns - 1
    held = sum(conv.prompt_len(c, last) + conv.output_len for c in range(len(conv.system_of)))
    shared = sum(len(conv.system_prompts[s]) for s in conv.system_of) - sum(
        len(conv.system_prompts[s]) for s in set(conv.system_of))
    return held - shared


def ratio(value: float, ref: float | None) -> str:
    """``value`` over ``ref`` ("-" without a reference)."""
    if ref is None or not ref or math.isnan(ref) or math.isnan(value):
        return "-"
    return f"{value / ref:.2f}x"


def summary(label: str, r: CaseResult) -> str:
    """One case's figures as a line, printed as soon as it ran."""
    return (f"{label}: TTFT p50 {1e3 * percentile(r.ttft_s, 50):.0f} ms, p99 "
            f"{1e3 * percentile(r.ttft_s, 99):.0f} ms, past --long-history p50 "
            f"{1e3 * percentile(r.long_ttft_s, 50):.0f} ms, {r.output_tok_s:.2f} out tok/s; "
            f"of {r.prompt_tokens} prompt tokens {r.pool_hit_tokens} from the pool, "
            f"{r.tier_hit_tokens[KV_TIER_HOST]} from host, {r.tier_hit_tokens[KV_TIER_DISK]} "
            f"from disk")


def print_tables(results: dict[str, CaseResult], plain: dict[str, float]) -> None:
    rows = []
    for label, r in results.items():
        ref = results.get(NO_REUSE + NO_TIERS if label.startswith(NO_REUSE) else NO_TIERS)
        figures = [(r.ttft_s, 50), (r.ttft_s, 99), (r.long_ttft_s, 50)]
        refs = [None] * 3 if ref is None else [(ref.ttft_s, 50), (ref.ttft_s, 99),
                                               (ref.long_ttft_s, 50)]
        row = [label, len(r.ttft_s)]
        for (values, q), against in zip(figures, refs, strict=True):
            ms = 1e3 * percentile(values, q)
            if values is r.long_ttft_s:
                row.append(len(values))
            row += [ms, ratio(ms, None if against is None else 1e3 * percentile(*against))]
        rows.append(row + [r.output_tok_s, ratio(r.output_tok_s, ref and ref.output_tok_s)])
    print(format_table(["case", "requests", "TTFT p50 ms", "vs none", "TTFT p99 ms",
                        "vs none", "long", "long p50 ms", "vs none", "out tok/s", "vs none"],
                       rows))
    print()
    rows = []
    for label, r in results.items():
        share = [r.pool_hit_tokens, r.tier_hit_tokens[KV_TIER_HOST],
                 r.tier_hit_tokens[KV_TIER_DISK]]
        computed = r.prompt_tokens - sum(share)
        rates = [r.read_bytes_per_s[t] for t in (KV_TIER_HOST, KV_TIER_DISK)]
        rows.append([label, r.prompt_tokens]
                    + [f"{100 * n / max(1, r.prompt_tokens):.1f}%" for n in [*share, computed]]
                    + ["-" if rate is None else rate / 1e9 for rate in rates])
    print(format_table(["case", "prompt tokens", "pool hit", "host hit", "disk hit",
                        "computed", "host read GB/s", "disk read GB/s"], rows))
    print("a plain copy of one block here: " + ", ".join(
        f"{name} {rate / 1e9:.2f} GB/s" for name, rate in plain.items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.kv_tiers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="the tiny model, a small workload")
    parser.add_argument("--conversations", type=int, default=None,
                        help="at least this many (default: what --working-set-ratio needs)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--system-len", type=int, default=300)
    parser.add_argument("--user-len", type=int, nargs=2, default=[100, 300],
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--working-set-ratio", type=float, default=4.0)
    parser.add_argument("--long-history", type=int, default=2048,
                        help="TTFT of prompts past this many tokens is shown apart")
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="the disk tier's folder is made in here (local disk)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's; --quick: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                        metavar="CASE", help=f"which to run (default all: {', '.join(CASES)}); "
                        "each is compared with its workload's case without tiers, run or not")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.system_len, args.user_len, args.output_len = 2, 16, [8, 16], 2
        args.max_num_seqs, args.long_history = 1, 24
        args.threads = args.threads or 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)


def kv_block_bytes(model: Path, block_size: int) -> int:
    """One KV block's bytes in an fp32 pool of ``model`` (the engine's memory ledger)."""
    with LLM(str(model), dtype="float32", block_size=block_size, num_kv_blocks=4) as llm:
        return llm.memory_ledger.kv_bytes_per_token * block_size


def tier_settings(case: str, working_set_bytes: int, folder: Path) -> dict:
    """The kv_offload_* settings of ``case`` (HOST, HOST_INT8 or HOST_DISK) for a working set
    of ``working_set_bytes``: a host tier of 1.25 times it, a third of it storing int8, or a
    quarter of it over a disk tier of twice it in ``folder``."""
    working_set = working_set_bytes / GIB
    if case == HOST:
        return dict(kv_offload_cpu_gib=1.25 * working_set)
    if case == HOST_INT8:
        return dict(kv_offload_cpu_gib=working_set / 3, kv_offload_int8=True)
    return dict(kv_offload_cpu_gib=working_set / 4, kv_offload_disk_gib=2 * working_set,
                kv_offload_dir=str(folder / "tier"))


def run(args: argparse.Namespace) -> None:
    model = args.model
    if model is None:
        model = PEER_MODEL if PEER_MODEL.is_dir() and not args.quick else tiny_model_dir()
    args.vocab_size = ModelConfig.from_hf_folder(model).vocab_size
    conv = size_workload(args)
    tokens = working_set_tokens(conv)
    print(f"model {model}, torch threads {torch.get_num_threads()}; {args.conversations} "
          f"conversations x {args.turns} turns over {args.system_prompts} system prompts of "
          f"{args.system_len} tokens, user messages of {args.user_len[0]}-{args.user_len[1]}, "
          f"answers of {args.output_len}, {args.max_num_seqs} at a time; pool "
          f"{args.num_kv_blocks} blocks of {args.block_size}, working set {tokens} tokens = "
          f"{tokens / (args.num_kv_blocks * args.block_size):.1f}x the pool")
    block_bytes = kv_block_bytes(model, args.block_size)
    working_set = -(-tokens // args.block_size) * block_bytes
    print(f"a block is {block_bytes / 2**20:.3f} MiB, the working set "
          f"{working_set / GIB:.3f} GiB")
    results: dict[str, CaseResult] = {}
    with tempfile.TemporaryDirectory(dir=args.disk_dir, prefix="kv-tiers-bench-") as folder:
        for name in dict.fromkeys(args.cases):  # in the order given
            tiers = {} if name.endswith(NO_TIERS) else tier_settings(
                name.removeprefix(NO_REUSE), working_set, Path(folder))
            results[name] = run_case(model, conv, name, not name.startswith(NO_REUSE), tiers,
                                     args)
            print(summary(name, results[name]), flush=True)
        plain = plain_copy_rates(block_bytes, Path(folder))
    print_tables(results, plain)


if __name__ == "__main__":
    main()
