"""What a schedule is made of: the scheduler's limits (:class:`SchedulerConfig`), one
sequence's share of a step (:class:`ScheduledSequence`) and the step's whole batch
(:class:`SchedulerOutput`), which the model runner, the speculator and the prefill worker's
hooks read. ``engine.step.scheduler`` makes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.engine.config import check_admission_hold
from pdserve.engine.sequence import Sequence


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one scheduler; validated on construction."""

    max_num_seqs: int = 256  # sequences in one step at most
    max_num_batched_tokens: int = 2048  # tokens in one step at most (chunked prefill budget)
    max_model_len: int  # context limit (prompt + output)
    enable_chunked_prefill: bool = True  # split long prompts over steps
    admission_hold_s: float = 0.0  # while sequences decode, a new prompt waits up to this
    # long from its arrival before it is admitted (Scheduler._holds_admission); 0: at once
    prefill_batch_tokens: int | None = None  # a further prompt is admitted only while the
    # step's prompt tokens stay within this (the first always goes); None: no bound

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        check_admission_hold(self.admission_hold_s)
        if self.prefill_batch_tokens is not None:
            _check_int("prefill_batch_tokens", self.prefill_batch_tokens, 1)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, "
                             f"got {self.enable_chunked_prefill!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_model_len ({self.max_model_len}) when chunked prefill is "
                             f"off, or a long prompt could never be scheduled")


class ScheduledSequence:
    """One sequence's tokens in a step, read from the sequence: a prompt chunk, or a
    speculating decode's token and draft slots (a plain slotted class: one is made per
    sequence per step, so construction stays cheap)."""

    __slots__ = ("seq", "num_new_tokens", "start", "samples", "num_lookahead",
                 "draft_token_ids")

    def __init__(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> None:
        self.seq = seq  # the sequence, its block table already covers the new tokens
        self.num_new_tokens = num_new_tokens  # computes token_ids[start : start + num_new]
        self.start = seq.num_computed_tokens  # first position computed this step
        # the chunk reaches the end of token_ids: sample a token
        self.samples = self.start + num_new_tokens >= len(seq.token_ids)
        # speculative decoding: KV slots allocated past the new tokens for drafts, and the
        # drafts proposed into them (at most num_lookahead; verified in this step's forward)
        self.num_lookahead = num_lookahead
        self.draft_token_ids: list[int] | tuple = ()

    @property
    def is_decode(self) -> bool:
        """Whether the chunk computes its sequence's last token alone (a decode as a chunk,
        with any draft slots), not prompt work."""
        return self.num_new_tokens == 1 and self.samples

    @property
    def num_scored(self) -> int:
        """The chunk's first rows whose logits score prompt tokens (prompt logprobs)."""
        return min(self.num_new_tokens, self.seq.num_prompt_rows_to_score)

    def __repr__(self) -> str:
        return (f"ScheduledSequence({self.seq.request_id!r}, start={self.start}, "
                f"num_new_tokens={self.num_new_tokens})")


@dataclass
class SchedulerOutput:
    """What the model runner computes this step, in batch order: the decodes, then the chunks.

    ``decodes`` are running sequences that compute their last token and sample the next; they
    are the model runner's persistent rows (``DecodeRows``), which move on by this step's diff:
    when ``decodes_version`` is the scheduler's ``running_version`` the rows mirror (a steady
    step: the same sequences as the last step's, plus ``joined``), only ``grown`` changed, each
    given ``new_blocks[i]``; otherwise (-1) the rows are matched to ``decodes`` by identity and
    read the blocks the schedule gave them from their tables. ``chunks`` are the sequences
    whose tokens are read from them this step: prompt chunks (a new request's first one, or
    the next of a running one) and speculating decodes (their token plus draft slots)."""

    decodes: list[Sequence] = field(default_factory=list)  # row order
    chunks: list[ScheduledSequence] = field(default_factory=list)  # after the decodes
    decodes_version: int = -1  # the running_version ``decodes`` is (-1: match by identity)
    joined: list[Sequence] = field(default_factory=list)  # in ``decodes``, new to running
    grown: list[Sequence] = field(default_factory=list)  # in ``decodes``, given a block
    new_blocks: list[int] = field(default_factory=list)  # the block each of ``grown`` got
    preempted: list[Sequence] = field(default_factory=list)  # preempted in this schedule()
    bounced: list[Sequence] = field(default_factory=list)  # preempted and handed back (ended)
    num_batched_tokens: int = 0  # one per decode, plus the chunks' tokens and draft slots

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.chunks

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.chunks)

    def sequences(self) -> Iterator[Sequence]:
        """Every sequence of the step, in batch order."""
        yield from self.decodes
        for item in self.chunks:
            yield item.seq

    def add_decode(self, seq: Sequence) -> None:
        """``seq`` computes its last token (its table covers it) and samples the next."""
        self.decodes.append(seq)
        self.num_batched_tokens += 1

    def add(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> None:
        """Schedule ``num_new_tokens`` of ``seq`` as a chunk (and ``num_lookahead`` draft
        slots)."""
        self.chunks.append(ScheduledSequence(seq, num_new_tokens, num_lookahead))
        self.num_batched_tokens += num_new_tokens + num_lookahead
