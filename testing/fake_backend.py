"""A model-free ``GenerationBackend``: a test double for the gRPC shell and a zero-compute
baseline for measuring streaming overhead per token.

Its "model" counts: after the prompt's last id ``t`` it generates ``t+1, t+2, ...`` (mod the
vocabulary), stopping at ``max_tokens``, a stop token id, or an eos id (unless
``ignore_eos``). Stop strings are not honoured. Text is one character per id
(``chr(FIRST_CHAR + id)``) and ``tokenize`` is the inverse, so text round-trips.

Knobs for tests, settable between requests: ``ready`` (False: ``generate`` raises
NoWorkersError, as the router does once its wait for a worker runs out), ``token_delay_s``
(sleep before each token), ``tokens_per_delta``, ``fail_with`` (raised from the first
``__anext__``). Every request started is recorded whole in ``started`` (its label in
``started_ids``, the tenant it counted under in ``tenants``), and every one closed or failed
before its last delta (an abort) in ``aborted_ids``, by its label, guarded by a lock so another
thread may read them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import AsyncIterator

from pdserve.router.backend import GenerationDelta, ModelSpec, PreparedRequest
from pdserve.router.constraints import ConstraintCheck
from pdserve.router.errors import NOT_READY, NoWorkersError
from pdserve.router.tool_calling import HermesParser
from pdserve.worker_api.sampling_params import SamplingParams, StructuredOutputs

logger = logging.getLogger(__name__)

FIRST_CHAR = 0x41  # id 0 is "A"


class FakeBackend:
    """Counts instead of running a model; see the module docstring."""

    def __init__(self, model: ModelSpec | None = None, *, ready: bool = True,
                 token_delay_s: float = 0.0, tokens_per_delta: int = 1) -> None:
        self.model = model or ModelSpec("fake-counter", max_context_tokens=256, vocab_size=64,
                                        eos_token_ids=(63,))
        self.ready = ready  # what is_ready() returns
        self.token_delay_s = token_delay_s  # sleep before each generated token
        self.tokens_per_delta = tokens_per_delta  # ids per yielded delta
        self.fail_with: Exception | None = None  # raised instead of the first delta
        self._lock = threading.Lock()
        self._started: list[PreparedRequest] = []  # what generate() was called with, in order
        self._aborted: list[str] = []  # labels of the streams ended early, in order
        self._running: set[str] = set()  # labels of the requests generating now

    @property
    def started(self) -> list[PreparedRequest]:
        with self._lock:
            return list(self._started)

    @property
    def started_ids(self) -> list[str]:
        return [request.label for request in self.started]

    @property
    def tenants(self) -> list[str | None]:
        return [request.tenant for request in self.started]

    @property
    def aborted_ids(self) -> list[str]:
        with self._lock:
            return list(self._aborted)

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(FIRST_CHAR + t) for t in token_ids)

    def expected_output(self, prompt_token_ids: list[int], params: SamplingParams
                        ) -> tuple[list[int], str]:
        """The ids and finish reason ``generate`` will produce (for tests to compare)."""
        ids: list[int] = []
        token_id = prompt_token_ids[-1]
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.model.eos_token_ids)
        while len(ids) < params.max_tokens:
            token_id = (token_id + 1) % self.model.vocab_size
            ids.append(token_id)
            if token_id in stop_ids:
                return ids, "stop"
        return ids, "length"

    async def generate(self, request: PreparedRequest) -> AsyncIterator[GenerationDelta]:
        request_id, params = request.label, request.params
        with self._lock:
            self._started.append(request)
            self._running.add(request_id)
        finished = False
        try:
            if not self.ready:
                raise NoWorkersError(NOT_READY)
            if self.fail_with is not None:
                raise self.fail_with
            ids, reason = self.expected_output(request.prompt_token_ids, params)
            step = max(1, self.tokens_per_delta)
            for index in range(params.num_sequences):  # (n > 1: each counts alike, in turn)
                for start in range(0, len(ids), step):
                    chunk = ids[start:start + step]
                    if self.token_delay_s > 0:
                        await asyncio.sleep(self.token_delay_s * len(chunk))
                    last = start + step >= len(ids)
                    finished = last and index == params.num_sequences - 1
                    prompt_logprobs = None
                    if index == start == 0 and params.prompt_logprobs is not None:
                        prompt = request.prompt_token_ids
                        prompt_logprobs = [None, *self._logprobs(prompt[1:],
                                                                 params.prompt_logprobs)]
                    yield GenerationDelta(
                        token_ids=chunk, text=self.decode(chunk),
                        logprobs=self._logprobs(chunk, params.logprobs),
                        finish_reason=reason if last else None,
                        prompt_logprobs=prompt_logprobs, index=index)
        finally:
            with self._lock:
                self._running.discard(request_id)
                if not finished:  # closed (or failed) before its last delta: aborted
                    self._aborted.append(request_id)

    def _logprobs(self, chunk: list[int], num_top: int | None) -> list[dict[int, float]] | None:
        if num_top is None:
            return None
        # The sampled id first with log(0.5), then the next ids with smaller mass.
        out = []
        for token_id in chunk:
            top = {token_id: math.log(0.5)}
            for rank in range(1, num_top):
                top[(token_id + rank) % self.model.vocab_size] = math.log(0.5 / (rank + 1))
            out.append(top)
        return out

    async def tokenize(self, text: str) -> list[int]:
        return [(ord(c) - FIRST_CHAR) % self.model.vocab_size for c in text]

    async def check_constraint(self, outputs: StructuredOutputs) -> ConstraintCheck | None:
        return None  # (no grammar engine: constraints are not checked here)

    def model_info(self) -> ModelSpec:
        return self.model

    def is_ready(self) -> bool:
        return self.ready


class FakePromptTools:
    """``PromptTools`` for the FakeBackend: a chat is rendered as ``role: content`` lines plus
    ``assistant:`` when asked, tokenized by the FakeBackend's one-character-per-id rule."""

    has_chat_template = True
    tool_call_parser = HermesParser()

    def __init__(self, backend: FakeBackend) -> None:
        self._backend = backend

    def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                    tools: list[dict] | None = None) -> list[int]:
        if messages[-1]["role"] == "assistant" and add_generation_prompt:
            raise ValueError("the last message is the assistant's already")
        text = "".join(f"tool: {t['function']['name']}\n" for t in tools or ())
        text += "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant:"
        vocab = self._backend.model.vocab_size
        return [(ord(c) - FIRST_CHAR) % vocab for c in text]

    def token_text(self, token_id: int) -> str:
        return self._backend.decode([token_id])
