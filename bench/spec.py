"""Speculative decoding benchmark: ``python -m pdserve.bench.spec [--quick]``. Prints; never
asserts.

Greedy output tokens/s with and without speculation at batch 1 and 16 on a random ~100M Llama
(``--quick``: the tiny Llama), in one run:

1. the target itself as the draft (acceptance 1: the ceiling of what acceptance can give; on a
   CPU the draft costs as much as the target, so this row shows the verification overhead);
2. a truncated-layer draft: the target's first 2 layers (same random draws; 1 with
   ``--quick``), with its own KV pool;
3. n-gram prompt lookup on a repetitive prompt.

Each row prints the acceptance rate, the mean acceptance length (tokens per speculating step:
accepted drafts + the target's own) and the speedup over plain decoding of the same prompts;
"same" says whether the speculative tokens equal the plain ones (greedy: they must).
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.engine import LLAMA_100M, LLAMA_TINY, write_random_llama
from pdserve.bench.stats import format_table
from pdserve.engine.llm import LLM
from pdserve.worker_api.sampling_params import SamplingParams


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def repetitive_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """A short phrase repeated (each request its own phrase): what prompt lookup is for."""
    rng = random.Random(1)
    out = []
    for _ in range(batch):
        phrase = [rng.randrange(3, vocab) for _ in range(8)]
        out.append((phrase * (length // 8 + 1))[:length])
    return out


def timed_generate(llm: LLM, prompts, max_tokens: int,
                   repeats: int = 1) -> tuple[float, list[list[int]]]:
    """(output tokens/s, tokens) of one greedy batch: the best of ``repeats`` runs after a
    warm-up run of the same batch (no prefix cache, so every run does the same work)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return sum(len(o.token_ids) for o in outs) / best, [o.token_ids for o in outs]


def make_llm(model: Path, spec: dict | None, max_model_len: int, max_batch: int) -> LLM:
    num_blocks = max_batch * -(-max_model_len // 16) + 8  # the largest batch's contexts
    return LLM(str(model), dtype="float32", num_kv_blocks=num_blocks, max_model_len=max_model_len,
               enable_prefix_caching=False, speculative_config=spec)


def run(model: Path, draft: Path, vocab: int, batches: list[int], prompt_len: int,
        max_tokens: int, k: int, draft_layers: int) -> str:
    max_model_len = prompt_len + max_tokens + 8
    workloads = {"random": lambda b: random_prompts(b, prompt_len, vocab),
                 "repetitive": lambda b: repetitive_prompts(b, prompt_len, vocab)}
    setups = [
        ("target as draft", "random",
         {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}),
        (f"{draft_layers}-layer draft", "random",
         {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}),
        ("n-gram lookup", "repetitive",
         {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
          "prompt_lookup_min": 2}),
    ]
    plain = make_llm(model, None, max_model_len, max(batches))
    baseline = {(w, b): timed_generate(plain, workloads[w](b), max_tokens)
                for w in workloads for b in batches}
    del plain
    rows = []
    for name, workload, spec in setups:
        llm = make_llm(model, spec, max_model_len, max(batches))
        for batch in batches:
            before = llm.spec_decode_stats()
            rate, tokens = timed_generate(llm, workloads[workload](batch), max_tokens)
            after = llm.spec_decode_stats()  # warm-up and repeats: the same greedy work
            drafts = after["num_drafts"] - before["num_drafts"]
            proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            base_rate, base_tokens = baseline[(workload, batch)]
            rows.append([name, workload, batch, base_rate, rate, f"{rate / base_rate:.2f}x",
                         f"{accepted / max(1, proposed):.1%}",
                         (accepted + drafts) / max(1, drafts),
                         "yes" if tokens == base_tokens else "NO"])
        del llm
        gc.collect()
    return format_table(["setup", "prompts", "batch", "plain tok/s", "spec tok/s", "speedup",
                         "acceptance", "mean accept len", "same"], rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few tokens (a smoke run)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    # tied embeddings: a draft of the first layers shares the target's embedding and lm_head
    config = {**LLAMA_TINY, "tie_word_embeddings": True} if args.quick else LLAMA_100M
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / ("tiny" if args.quick else "llama100m"), **config)
        draft_layers = 1 if args.quick else 2  # the target's first layers (same draws)
        draft = write_random_llama(Path(tmp) / "draft", **{**config,
                                                           "num_hidden_layers": draft_layers})
        print(f"threads {torch.get_num_threads()}, target {config['num_hidden_layers']} layers, "
              f"hidden {config['hidden_size']}, K = {args.num_speculative_tokens}\n")
        print(run(model, draft, config["vocab_size"], [1, 16], 16 if args.quick else 32,
                  12 if args.quick else 24, args.num_speculative_tokens, draft_layers))


if __name__ == "__main__":
    main()
