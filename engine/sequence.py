"""One state object per request: token ids, progress counters, block table and status."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.deltas import PrefixSource
from pdserve.worker_api.sampling_params import SamplingParams


class SequenceStatus(IntEnum):
    """Ordered so that ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0  # queued for (re)computation of its prompt
    WAITING_FOR_KV = 1  # decode worker: blocks reserved, KV arriving from a prefill worker
    RUNNING = 2  # in the running batch
    SENDING_KV = 3  # prefill worker: prompt done, KV still shipping to the decode worker
    FINISHED_STOPPED = 4  # eos, stop token id or stop string
    FINISHED_LENGTH = 5  # max_tokens or the model's context
    FINISHED_ABORTED = 6  # cancelled, deadline, or failure

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                SequenceStatus.FINISHED_ABORTED: "abort"}.get(self)


class OutputConstraint(Protocol):
    """Where a constrained request is in its grammar (``engine/sampling/grammar.py``)."""

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_terminated(self) -> bool: ...


@dataclass
class Sequence:
    """A request's state inside one engine.

    ``block_table[i]`` holds tokens ``[i * block_size, (i + 1) * block_size)``; an entry is
    ``None`` once a sliding window has freed that block. The table only grows (until freed).
    """

    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    sampling_params: SamplingParams
    num_prompt_tokens: int = -1  # set from token_ids in __post_init__
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (last admission)
    prefix_source: PrefixSource | None = None  # where those came from (the pool, a KV tier)
    block_table: list[int | None] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    seed: int = 0  # random stream key (sampling_params.seed or chosen by the engine)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when the first chunk ran (queue time ends)
    first_token_time: float | None = None
    num_preemptions: int = 0
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    deadline: float | None = None  # time.time() after which the engine drops it
    num_resumed_tokens: int = 0  # outputs streamed by an earlier worker (a migrated request)
    attempt: int = 1  # the router's attempt epoch, echoed in this sequence's deltas
    num_draft_computed_tokens: int = 0  # speculative decoding: tokens whose KV the draft model
    # holds (in the draft's pool, same block table); preemption resets it
    # structured output: the grammar's matcher, moved on by every output token (None: free)
    constraint: OutputConstraint | None = None
    # prompt logprobs (sampling_params.prompt_logprobs): entry i for prompt token i (entry 0
    # None), filled as the prompt's chunks run, handed to the first output's delta; None when
    # not asked or already handed. While set, the prefix cache serves the sequence nothing.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    index: int = 0  # which of its request's n (best_of) sequences; 0 also when n == 1
    adapter: AdapterRef | None = None  # the LoRA adapter it runs under (None: the base model)
    lora_slot: int = -1  # the adapter's slot while the sequence pins it (engine/adapters.py)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens this engine computes before its first sample: prompt + resumed outputs."""
        return self.num_prompt_tokens + self.num_resumed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_prompt_rows_to_score(self) -> int:
        """Positions from ``num_computed_tokens`` on whose logits give a prompt token's logprob
        (position p scores token p + 1); 0 when prompt logprobs are not wanted."""
        if self.prompt_logprobs is None:
            return 0
        return max(0, self.num_prompt_tokens - 1 - self.num_computed_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
