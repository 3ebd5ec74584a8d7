"""Small policy objects that make the scheduler's ordering and admission decisions.

The :class:`~pdserve.engine.scheduler.Scheduler` owns the queues and the block bookkeeping;
a policy answers four questions, each a short pure function:

1. ``order_running``: in which order do running sequences claim this step's token budget?
2. ``num_new_tokens``: how many tokens does a sequence compute this step (0 = skip it)?
3. ``pick_victim``: which running sequence is preempted when blocks run out?
4. ``next_waiting``: which waiting sequence is admitted next?

plus two constants saying which entry points the role accepts (``add`` for prompts,
``add_running`` for sequences whose KV was computed elsewhere). A worker role picks its
policy at construction; the scheduler has no role flags.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from pdserve.engine.sequence import Sequence


class SchedulingPolicy:
    """Colocated default: decodes first, then running prefill chunks, then FCFS admission.

    Preemption takes the most recently admitted sequence (the tail of the running list).
    """

    name = "colocated"
    accepts_prompts = True  # Scheduler.add takes new prompts
    accepts_running = True  # Scheduler.add_running takes already computed sequences

    def order_running(self, running: SequenceOf[Sequence]) -> list[Sequence]:
        """Decodes (one token left to compute) first, then partial prefills; stable."""
        decodes = [s for s in running if s.num_uncomputed_tokens == 1]
        others = [s for s in running if s.num_uncomputed_tokens != 1]
        return decodes + others

    def num_new_tokens(self, seq: Sequence, num_computed_tokens: int, budget: int,
                       enable_chunked_prefill: bool) -> int:
        """Tokens to compute from num_computed_tokens on within budget; 0 when it must wait."""
        remaining = seq.num_tokens - num_computed_tokens
        if remaining <= 0 or budget <= 0:
            return 0
        if remaining <= budget:
            return remaining
        return budget if enable_chunked_prefill else 0

    def pick_victim(self, candidates: SequenceOf[Sequence]) -> Sequence:
        """candidates: unscheduled running sequences in admission order; take the newest."""
        return candidates[-1]

    def next_waiting(self, waiting: SequenceOf[Sequence]) -> Sequence | None:
        """First come, first served; preempted sequences were put back at the front."""
        return waiting[0] if waiting else None


class PrefillOnlyPolicy(SchedulingPolicy):
    """Prefill worker: a sequence stops computing once its prompt is done.

    The worker samples token 0 on the last chunk and hands the sequence off
    (``Scheduler.hand_off``) while its KV ships; until then it is skipped, never decoded.
    """

    name = "prefill"
    accepts_running = False

    def num_new_tokens(self, seq: Sequence, num_computed_tokens: int, budget: int,
                       enable_chunked_prefill: bool) -> int:
        # Everything queued is computed before the one sample: the prompt, plus the outputs
        # already streamed when a migrated request resumes.
        if num_computed_tokens >= seq.num_prefill_tokens:
            return 0
        return super().num_new_tokens(seq, num_computed_tokens, budget, enable_chunked_prefill)


class DecodeOnlyPolicy(SchedulingPolicy):
    """Decode worker: sequences arrive computed through ``add_running``.

    A preempted sequence still recomputes its tokens here (waiting queue, chunked), so the
    decode worker never loses a request for lack of blocks.
    """

    name = "decode"
    accepts_prompts = False
