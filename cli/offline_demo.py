"""The offline demo: the engine on the built-in tiny model, real prompts, a latency summary and
the memory ledger. (The served demo in ``cluster.demo`` supersedes it once the cluster exists.)"""

from __future__ import annotations

import logging
import random
import time

from pdserve.bench.stats import format_table, lognormal_lengths, summarize
from pdserve.engine.llm import LLM
from pdserve.models import tiny_model_dir
from pdserve.worker_api.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew "
         "strange potions under an amber sky").split()


def make_prompts(rng: random.Random, n: int) -> tuple[list[str], list[int]]:
    """Prompts of long-tailed word counts, and long-tailed output lengths."""
    prompt_words = lognormal_lengths(rng, n, mean=40, high=400)
    outputs = lognormal_lengths(rng, n, mean=40, high=200)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(k)) for k in prompt_words]
    return prompts, outputs


def run_offline_demo(num_requests: int = 32, seed: int = 0, model: str | None = None,
                     engine: dict | None = None) -> None:
    """``engine``: EngineConfig keywords over the demo's ``max_num_seqs=32``."""
    rng = random.Random(seed)
    llm = LLM(str(model or tiny_model_dir()), **{"max_num_seqs": 32, **(engine or {})})
    prompts, output_lens = make_prompts(rng, num_requests)
    params = [SamplingParams(max_tokens=m, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
              for i, m in enumerate(output_lens)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    ttft = [o.ttft_s for o in outputs]
    e2e = [o.e2e_s for o in outputs]
    tpot = [(o.e2e_s - o.ttft_s) / max(1, len(o.token_ids) - 1) for o in outputs]
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"\n{num_requests} requests, {generated} tokens generated in {wall:.2f} s "
          f"({generated / wall:,.0f} tok/s) on "
          f"{model or 'the built-in tiny model (random weights)'}\n")
    rows = [[name] + [v * 1000 for v in summarize(vals).values()]
            for name, vals in (("TTFT ms", ttft), ("TPOT ms", tpot), ("e2e ms", e2e))]
    print(format_table(["latency", "mean", "P50", "P90", "P99"], rows))
    print("\nmemory ledger")
    print(format_table(["account", "value"], [list(r) for r in llm.memory_ledger.rows()]))
    print(f"\nsample: {outputs[0].text[:80]!r}")
