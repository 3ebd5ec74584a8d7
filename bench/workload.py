"""What a load benchmark sends, and when: datasets and arrival times (``pdserve bench``).

* ``synthetic``: token-id prompts whose input and output lengths are log-normal (long-tailed,
  ShareGPT-like means ~220 in / ~200 out by default), each request capped so prompt + output
  fits the model's context.
* ``prefix``: what a prefix cache is for: conversations over a few shared system prompts
  (each about ``input_mean`` tokens), each turn resending the whole history (system prompt,
  earlier questions and answers) plus a new question. The next turn is a random
  conversation's; an answer is
  random ids of the turn's output length (the client cannot know the model's), so the part a
  prefix cache can serve is the history, as with a real chat client.
* ``jsonl``: one request per line, ``{"prompt": "text"}`` or ``{"prompt": [ids]}`` or
  ``{"prompt_len": N}`` (N random ids), with an optional ``"output_len"`` (else drawn as the
  synthetic output lengths are). Lines are used in file order, cycled if ``n`` exceeds them.

Arrivals follow vLLM's ``bench serve``: gaps drawn from a gamma distribution of shape
``burstiness`` and mean 1 / ``rate`` (``burstiness`` 1 is a Poisson process; below 1 burstier,
above 1 more regular); an infinite rate sends everything at time 0. Everything is seeded, so
the same seed replays the same trace.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.stats import lognormal_lengths

FIRST_ID = 3  # random prompt ids start here (0-2 are pad/bos/eos in the built-in model)
DATASETS = ("synthetic", "prefix", "jsonl")  # what ``pdserve bench serve --dataset`` takes


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark trace."""

    index: int  # position in the trace
    prompt: str | list[int]  # text or token ids
    prompt_len: int  # tokens (text prompts: 0 until the server's usage says)
    output_len: int  # max_tokens (sent with ignore_eos, so exactly this many)


@dataclass
class RequestOutcome:
    """One request as the client saw it (seconds)."""

    request_id: str
    prompt_len: int  # the server's usage count when it sent one, else the dataset's
    output_len: int = 0  # tokens received
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between later chunks
    e2el: float = 0.0
    start: float = 0.0  # sent at, from the benchmark's start
    success: bool = False
    error: str = ""  # status code and message of a failed request

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


@dataclass(frozen=True)
class SyntheticShape:
    """Length distributions of the synthetic dataset."""

    input_mean: float = 220.0  # mean prompt tokens
    output_mean: float = 200.0  # mean output tokens
    sigma: float = 0.8  # log-normal shape: larger is longer-tailed
    min_input: int = 4
    min_output: int = 2


def synthetic_requests(n: int, seed: int, vocab_size: int, max_context: int,
                       shape: SyntheticShape = SyntheticShape()) -> list[BenchRequest]:
    """``n`` token-id prompts (see the module docstring)."""
    rng = random.Random(seed)
    inputs = lognormal_lengths(rng, n, shape.input_mean, shape.sigma, shape.min_input,
                               max_context - shape.min_output)
    outputs = lognormal_lengths(rng, n, shape.output_mean, shape.sigma, shape.min_output,
                                max_context - shape.min_input)
    out = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs, strict=True)):
        n_out = min(n_out, max_context - n_in)
        out.append(BenchRequest(i, random_ids(rng, n_in, vocab_size), n_in, n_out))
    return out


NUM_SYSTEM_PROMPTS = 4  # the prefix dataset's shared system prompts
NUM_CONVERSATIONS = 16  # its conversations, one of them writing at each turn
QUESTION_TOKENS = (16, 64)  # a new question's length, drawn uniformly


def prefix_requests(n: int, seed: int, vocab_size: int, max_context: int,
                    shape: SyntheticShape = SyntheticShape()) -> list[BenchRequest]:
    """``n`` turns of conversations over shared system prompts (see the module docstring);
    a conversation whose history no longer fits the context starts over."""
    rng = random.Random(seed)
    system = [random_ids(rng, max(shape.min_input, int(shape.input_mean)), vocab_size)
              for _ in range(NUM_SYSTEM_PROMPTS)]
    outputs = lognormal_lengths(rng, n, shape.output_mean, shape.sigma,
                                shape.min_output, max_context // 4)
    histories = [list(system[c % NUM_SYSTEM_PROMPTS]) for c in range(NUM_CONVERSATIONS)]
    out = []
    for i, n_out in enumerate(outputs):
        c = rng.randrange(NUM_CONVERSATIONS)  # (whichever user writes next)
        question = random_ids(rng, rng.randint(*QUESTION_TOKENS), vocab_size)
        if len(histories[c]) + len(question) + n_out > max_context:
            histories[c] = list(system[c % NUM_SYSTEM_PROMPTS])  # a new conversation
        prompt = histories[c] + question
        n_out = min(n_out, max_context - len(prompt))
        out.append(BenchRequest(i, prompt, len(prompt), n_out))
        histories[c] = prompt + random_ids(rng, n_out, vocab_size)  # its answer
    return out


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def jsonl_requests(path: str | Path, n: int, seed: int, vocab_size: int, max_context: int,
                   shape: SyntheticShape = SyntheticShape()) -> list[BenchRequest]:
    """``n`` requests from a JSON-lines file (see the module docstring); ValueError naming the
    line for one that has no usable prompt."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no requests")
    rng = random.Random(seed)
    fallback = lognormal_lengths(rng, n, shape.output_mean, shape.sigma, shape.min_output,
                                 max_context)
    out = []
    for i in range(n):
        number = i % len(lines) + 1
        try:
            row = json.loads(lines[number - 1])
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
        prompt, prompt_len = _prompt(row, rng, vocab_size, f"{path}:{number}")
        output_len = int(row.get("output_len", fallback[i]))
        if output_len < 1:
            raise ValueError(f"{path}:{number}: output_len must be >= 1, got {output_len}")
        if prompt_len:
            output_len = max(1, min(output_len, max_context - prompt_len))
        out.append(BenchRequest(i, prompt, prompt_len, output_len))
    return out


def _prompt(row: dict, rng: random.Random, vocab_size: int, where: str
            ) -> tuple[str | list[int], int]:
    prompt = row.get("prompt")
    if isinstance(prompt, str) and prompt:
        return prompt, 0
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt, len(prompt)
    if "prompt_len" in row and int(row["prompt_len"]) >= 1:
        n = int(row["prompt_len"])
        return random_ids(rng, n, vocab_size), n
    raise ValueError(f"{where}: needs \"prompt\" (text or token ids) or \"prompt_len\" >= 1")


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of ``n`` requests is sent (module docstring)."""
    if not rate > 0:
        raise ValueError(f"request_rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.gammavariate(burstiness, scale)
    return times
