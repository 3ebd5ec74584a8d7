"""What the front doors need from whatever generates tokens behind them.

Two implementations: the router core (``pdserve.router.core.Router``: prefill + decode
workers, or colocated ones) and ``pdserve.testing.fake_backend``, a model-free one for tests
and for measuring the streaming overhead.

Call order for one request, as both front doors make it:

1. ``model_info()`` gives the limits the doors and the preparation stage check against.
   ``is_ready()`` is what health reports; a backend not ready still gets ``generate`` calls
   (the router waits for a ready worker up to the request's deadline; a backend that cannot
   wait raises NoWorkersError).
2. ``tokenize(text)`` when the prompt came as text, and ``check_constraint(outputs)`` when the
   request constrains its output (``pdserve.router.prepare`` calls both).
3. ``generate(request)`` is iterated, ``request`` the :class:`PreparedRequest` the preparation
   stage returned; admission failures (``QueueFullError``, ``RequestTooLargeError``,
   ``NoWorkersError`` from ``pdserve.router.errors``) are raised from the first
   ``__anext__``. Each item is a ``GenerationDelta``; the last one has ``finish_reason`` set
   and nothing follows it. A request of ``n`` (``best_of``) > 1 streams each sequence's
   deltas under its ``index``, interleaved; each sequence's last delta has its
   ``finish_reason``, and the stream ends after the last sequence's. ``request.label`` is
   the client's id for the request (or one the door made): the backend may log it, never
   key anything on it; it makes its own ids, so two requests with one label are two
   requests.
4. The front door closes the iterator when it is done with it, however the stream ended
   (both doors do it with :func:`end_stream`). Closing a stream before its last delta
   (client cancel, deadline, error, server stop) aborts the request: the backend frees
   everything it holds (KV blocks on every worker). The stream is the only handle on the
   request, so nothing else can abort it.

A backend must not block the event loop: ``generate`` buffers deltas for slow clients rather
than making its engine wait on them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pdserve.router.constraints import ConstraintCheck
from pdserve.router.otel import RequestOrigin
from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.sampling_params import SamplingParams, StructuredOutputs

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class ModelSpec:
    """The served model's limits, as validation and GetModelInfo need them."""

    model_name: str  # name reported to clients
    max_context_tokens: int  # prompt + generated tokens at most
    vocab_size: int  # valid token ids are [0, vocab_size)
    eos_token_ids: tuple[int, ...] = ()  # ids that end generation unless ignore_eos

    def __post_init__(self) -> None:
        if not isinstance(self.max_context_tokens, int) or self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be an integer >= 2, "
                             f"got {self.max_context_tokens!r}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for token_id in self.eos_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"eos_token_ids must be in [0, {self.vocab_size}), "
                                 f"got {token_id!r}")


@dataclass
class GenerationDelta:
    """Tokens generated since the previous delta of the same request."""

    token_ids: list[int]  # new ids, in order (may be empty, e.g. a bare finish)
    text: str = ""  # text those ids add (stop strings already cut)
    logprobs: list[dict[int, float]] | None = None  # per id in token_ids: top id -> logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta only
    # the first delta only, when the request asked (SamplingParams.prompt_logprobs): one
    # entry per prompt token, top id -> logprob with the prompt token's own; the first None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    index: int = 0  # which of the request's n (best_of) sequences, 0..n-1 (with n > 1
    # each index ends with its own finish_reason)

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"logprobs must have one entry per token id "
                             f"({len(self.token_ids)}), got {len(self.logprobs)}")


@dataclass(frozen=True)
class PreparedRequest:
    """One request as the preparation stage (``pdserve.router.prepare``) made it, the same
    whichever door it came through: what ``GenerationBackend.generate`` takes."""

    label: str  # the client's id (or the door's): echoed and logged, never a key
    prompt_token_ids: list[int]  # non-empty, inside the vocabulary, shorter than the context
    params: SamplingParams  # max_tokens resolved: prompt + max_tokens fit the context
    max_tokens: int | None  # as the client gave it; None: it gave none, so params.max_tokens
    # is a ceiling the backend may lower to what one worker holds instead of refusing
    deadline: float | None = None  # time.monotonic() instant; None: no deadline
    tenant: str | None = None  # who it counts under for fair turns (None: anonymous)
    constraint_check: ConstraintCheck | None = None  # how the router checked its structured
    # output (None: free output, or a backend that does not check)
    adapter: AdapterRef | None = None  # the LoRA adapter the request's ``model`` named (None:
    # the base model)
    origin: RequestOrigin | None = None  # its door, when it came in and the caller's trace
    # context (None: not from a front door)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens != self.params.max_tokens:
            raise ValueError(f"max_tokens must be None or params.max_tokens "
                             f"({self.params.max_tokens}), got {self.max_tokens!r}")


@runtime_checkable
class GenerationBackend(Protocol):
    """Generates tokens for prepared requests; see the module docstring for the call order."""

    def generate(self, request: PreparedRequest) -> AsyncIterator[GenerationDelta]:
        """Stream the request's deltas; an ``async def`` with ``yield`` fits.

        ``request.deadline`` is the instant after which the request is worthless; the door
        also enforces it and then closes the stream. ``request.tenant`` names who sent it
        (fair share inside a priority level). With ``request.max_tokens`` None the backend may
        lower ``params.max_tokens`` to what one worker can hold instead of refusing.
        """
        ...

    async def tokenize(self, text: str) -> list[int]:
        """The prompt's token ids, as the engine would see them (special tokens included)."""
        ...

    async def check_constraint(self, outputs: StructuredOutputs) -> ConstraintCheck | None:
        """Check that workers can compile ``outputs`` before any sees it: ConstraintRefused
        (a ValueError saying why) when they cannot; None when this backend does not check."""
        ...

    def model_info(self) -> ModelSpec:
        """The served model's limits; called per request, so keep it cheap."""
        ...

    def is_ready(self) -> bool:
        """True once workers can take requests; polled for the health service."""
        ...


async def end_stream(deltas: AsyncIterator[GenerationDelta]) -> None:
    """Step 4 of the call order, for a front door's ``finally``: close the stream (which
    aborts the request unless its last delta was read), shielded from the caller's
    cancellation so the abort completes. Failures are logged, not raised."""
    close = getattr(deltas, "aclose", None)
    if close is None or getattr(deltas, "ag_running", False):
        # (running: a task the caller drove it in, such as wait_for's, was cancelled and is
        # running the stream's own end, its abort included)
        return
    try:
        await asyncio.shield(close())
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("closing a backend stream failed")
