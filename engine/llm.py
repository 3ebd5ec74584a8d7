"""The offline API: ``LLM(model_dir).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from tqdm.auto import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.models.lora_files import adapter_digest
from pdserve.worker_api import RequestDelta, StepDeltas, choice_request_id
from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """One finished request, or one of its ``n`` completions (``index``)."""

    request_id: str
    prompt_token_ids: list[int]
    index: int = 0  # which of the request's n completions (0 when n == 1)
    token_ids: list[int] = field(default_factory=list)  # generated ids only
    text: str = ""  # generated text (stop strings excluded)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None = None  # per generated token, when requested
    # per prompt token, when SamplingParams.prompt_logprobs asks (the first entry None)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' log-probabilities (None without logprobs)."""
        if self.logprobs is None:
            return None
        return sum(entry[token_id] for entry, token_id in zip(self.logprobs, self.token_ids,
                                                               strict=True))

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    def add_token(self, token_id: int, text: str, now: float) -> None:
        """A delta that only adds one token (not the last, no logprobs)."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.append(token_id)
        self.text += text

    def add(self, delta: RequestDelta, now: float) -> None:
        if delta.new_token_ids and self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.finish_time = delta.finish_reason, now


class LLM:
    """Offline batch generation on one engine. Keywords are :class:`EngineConfig` fields."""

    def __init__(self, model: str, **engine_kwargs):
        valid = [f.name for f in fields(EngineConfig) if f.name != "model"]
        unknown = sorted(set(engine_kwargs) - set(valid))
        if unknown:
            raise ValueError(f"LLM() got unknown keyword(s) {', '.join(unknown)}; valid "
                             f"keywords are the EngineConfig fields: {', '.join(valid)}")
        self.engine = LLMEngine.from_config(EngineConfig(model=str(model), **engine_kwargs))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop what the engine runs beside this process (tensor parallel ranks); also done
        when the LLM is collected or the interpreter exits."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.parts.tokenizer

    @property
    def memory_ledger(self):
        return self.engine.parts.ledger

    def spec_decode_stats(self) -> dict | None:
        """Speculative decoding since this LLM started: num_drafts, num_draft_tokens,
        num_accepted_tokens, acceptance_rate, mean_acceptance_length (None when off)."""
        speculator = self.engine.speculator
        return None if speculator is None else speculator.stats.to_dict()

    @staticmethod
    def adapter(path: str | Path, name: str | None = None) -> AdapterRef:
        """The LoRA adapter in the PEFT folder ``path`` (named after the folder unless
        ``name``), for :meth:`generate`'s ``adapters``; the engine needs ``enable_lora``."""
        folder = Path(path)
        try:
            digest = adapter_digest(folder)
        except OSError as exc:
            raise ValueError(f"LoRA adapter at {folder}: {exc}") from None
        return AdapterRef(name or folder.name, str(folder), digest)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 adapters: AdapterRef | list[AdapterRef | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs in input order.
        A prompt whose params have ``n`` > 1 gives its ``n`` outputs one after another
        (``index`` 0..n-1), forked from one prefill; with ``best_of`` the ``n`` of highest
        cumulative log-probability, best first. ``adapters``: the LoRA adapter (:meth:`adapter`)
        of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: got {len(per_prompt)} for {len(prompts)} prompts")
        per_adapter = adapters if isinstance(adapters, list) else [adapters] * len(prompts)
        if len(per_adapter) != len(prompts):
            raise ValueError(f"adapters: got {len(per_adapter)} for {len(prompts)} prompts")
        outputs: dict[str, RequestOutput] = {}  # by the id of each sequence
        requests = []  # (request_id, params, its sequence 0)
        try:
            for prompt, p, adapter in zip(prompts, per_prompt, per_adapter, strict=True):
                request_id = f"offline-{next(self._ids)}"
                seq = self.engine.add_request(request_id, prompt, p, adapter=adapter)
                requests.append((request_id, p, seq))
                for index in range(p.num_sequences):
                    outputs[choice_request_id(request_id, index)] = RequestOutput(
                        request_id, list(seq.token_ids), index, arrival_time=seq.arrival_time)
            self._run(outputs, use_tqdm)
        finally:
            for request_id, _, _ in requests:
                self.engine.abort(request_id)  # (idempotent; every sequence of it)
        results = []
        for request_id, p, seq in requests:
            outs = [outputs[choice_request_id(request_id, i)] for i in range(p.num_sequences)]
            for out in outs:
                out.num_cached_tokens = seq.num_cached_tokens
            results += best_of(outs, p)
        return results

    def _run(self, outputs: dict[str, RequestOutput], use_tqdm: bool) -> None:
        pending = len(outputs)
        with tqdm(total=pending, desc="generate", unit="req", disable=not use_tqdm) as bar:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine went idle with requests unfinished")
                step = self.engine.step()
                finished = self._take(self.engine.render(step), outputs, time.monotonic())
                if finished:
                    pending -= finished
                    bar.update(finished)

    @staticmethod
    def _take(deltas: StepDeltas, outputs: dict[str, RequestOutput], now: float) -> int:
        """Add a step's deltas to their outputs; returns how many requests finished."""
        finished = 0

        def add(delta: RequestDelta) -> None:
            nonlocal finished
            outputs[delta.request_id].add(delta, now)
            finished += delta.finish_reason is not None

        deltas.read(lambda request_id, token_id, text:
                    outputs[request_id].add_token(token_id, text, now), add)
        return finished


def best_of(outs: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """A request's outputs as returned: all ``n``, or with ``best_of`` the ``n`` of highest
    cumulative log-probability, best first, re-indexed 0..n-1 (their logprobs kept only when
    the request asked for them)."""
    if params.num_sequences == params.n:
        return outs
    ranked = sorted(outs, key=lambda out: out.cumulative_logprob or 0.0, reverse=True)
    kept = ranked[:params.n]
    for index, out in enumerate(kept):
        out.index = index
        if params.logprobs is None:
            out.logprobs = None
    return kept
