"""Small policy objects that make the scheduler's ordering and admission decisions.

The :class:`~pdserve.engine.step.scheduler.Scheduler` owns the queues and the block bookkeeping;
a policy answers five questions, each a short pure function:

1. ``order_running``: in which order do running sequences claim this step's token budget?
2. ``num_new_tokens``: how many tokens does a sequence compute this step (0 = skip it)?
3. ``pick_victim``: which running sequence is preempted when blocks run out?
4. ``next_waiting``: which waiting sequence is admitted next?
5. ``defers``: does a running prefill chunk yield this step to a better waiting request?

plus a constant saying whether the role accepts ``add_running`` (sequences whose KV was
computed elsewhere); every role takes prompts through ``add``. A worker role picks its
policy at construction; the scheduler has no role flags.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from pdserve.engine.sequence import Sequence

ORDERINGS = ("fcfs", "priority")


def priority_key(seq: Sequence) -> tuple:
    """Priority scheduling order: lower ``priority`` first, ties by arrival (vLLM's rule)."""
    return seq.sampling_params.priority, seq.arrival_time


class SchedulingPolicy:
    """Colocated default: decodes first, then running prefill chunks, then admission.

    ``ordering`` "fcfs": admission first come, first served; preemption takes the most
    recently admitted sequence (the tail of the running list). "priority": admission, the
    order inside decodes and inside prefills, and the victim all follow ``priority_key``
    (lowest priority, newest, is preempted first), and a running prefill chunk of a request
    whose priority is worse than a waiting one's yields the step's budget to it (``defers``),
    so a long low-priority prompt never blocks a short high-priority one.
    """

    name = "colocated"
    accepts_running = True  # Scheduler.add_running takes already computed sequences
    preempt_kind = "recompute"  # a victim recomputes here ("bounce": handed back instead)
    speculates = True  # decodes may take speculative drafts (EngineConfig.speculative_config)
    # A decode (one token left) computes it whenever budget is left and never defers; the
    # scheduler then takes its fast path without asking num_new_tokens / defers.
    decodes_take_one_token = True
    # Decodes (none speculating) are the model runner's persistent rows
    # (SchedulerOutput.decodes); off, every sequence of a step is a chunk built for it.
    decodes_on_rows = True

    def __init__(self, ordering: str = "fcfs") -> None:
        if ordering not in ORDERINGS:
            raise ValueError(f"scheduling_policy must be one of {ORDERINGS}, got {ordering!r}")
        self.ordering = ordering

    @property
    def by_priority(self) -> bool:
        return self.ordering == "priority"

    def order_running(self, running: SequenceOf[Sequence]) -> list[Sequence]:
        """Decodes (one token left to compute) first, then partial prefills; stable."""
        decodes, others = [], []
        for s in running:  # (inlined: this runs for every sequence every step)
            (decodes if len(s.token_ids) - s.num_computed_tokens == 1 else others).append(s)
        if self.by_priority:
            decodes.sort(key=priority_key)
            others.sort(key=priority_key)
        return decodes + others

    def defers(self, seq: Sequence, waiting: SequenceOf[Sequence]) -> bool:
        """Should running prefill ``seq`` let a better waiting request go first this step?"""
        if not self.by_priority or seq.num_uncomputed_tokens == 1 or not waiting:
            return False
        return min(priority_key(w) for w in waiting) < priority_key(seq)

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
        """candidates: unscheduled running sequences in admission order."""
        if self.by_priority:
            return max(candidates, key=priority_key)
        return candidates[-1]

    def next_waiting(self, waiting: SequenceOf[Sequence]) -> Sequence | None:
        """FCFS: the head (preempted sequences were put back at the front); priority: best."""
        if not waiting:
            return None
        return min(waiting, key=priority_key) if self.by_priority else waiting[0]


class PrefillOnlyPolicy(SchedulingPolicy):
    """Prefill worker: a sequence stops computing once its prompt is done.

    The worker samples token 0 on the last chunk and hands the sequence off
    (``Scheduler.hand_off``) while its KV ships; until then it is skipped, never decoded.
    """

    name = "prefill"
    accepts_running = False
    speculates = False  # samples token 0 only: a speculative_config is ignored here
    decodes_take_one_token = False  # a prompt's last token is computed once, never decoded
    decodes_on_rows = False  # (none decodes; its hooks see every sequence that samples)

    def num_new_tokens(self, seq: Sequence, num_computed_tokens: int, budget: int,
                       enable_chunked_prefill: bool) -> int:
        # Everything queued is computed before the one sample: the prompt, plus the outputs
        # already streamed when a migrated request resumes.
        if num_computed_tokens >= seq.num_prefill_tokens:
            return 0
        return super().num_new_tokens(seq, num_computed_tokens, budget, enable_chunked_prefill)


class DecodePolicy(SchedulingPolicy):
    """Decode worker: sequences arrive computed through ``add_running``, except the prompts
    the router chooses to prefill here (conditional disaggregation, ``router.pairing``),
    which arrive through ``add`` and are chunked into the decode steps as a colocated
    worker's are.

    A preempted sequence is handed back (``preempt_kind = "bounce"``): its blocks are freed
    and the worker tells the router, which places it again (prefilling it anew) when room
    returns.
    """

    name = "decode"
    preempt_kind = "bounce"
