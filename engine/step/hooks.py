"""What a worker role adds around the engine's one step (:class:`StepHooks`), and where a
step's time went (:class:`StepStats`).

Roles differ in two kinds of policy object, never in a copy of ``LLMEngine.step``: the
scheduling policy (``engine.step.scheduling_policy``: what is scheduled) and these hooks (what
happens around the forward). The prefill worker's hooks open the KV shipments of the prompts
a step completes and hand them off; every other role keeps the default, which adds nothing.
Hooks see a step's chunks (``SchedulerOutput.chunks``), not its decodes (the runner's
persistent rows); the prefill worker's policy has no decodes
(``SchedulingPolicy.decodes_on_rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence
from pdserve.engine.step.scheduler_output import ScheduledSequence
from pdserve.worker_api import RequestDelta


@dataclass
class StepStats:
    """Where one step's wall time went."""

    num_tokens: int = 0  # tokens computed
    num_seqs: int = 0  # sequences in the batch
    forward_s: float = 0.0  # model forward incl. logits
    total_s: float = 0.0  # whole step: scheduling, forward, sampling, bookkeeping


class StepHooks:
    """What a worker role adds around the one step; the default adds nothing."""

    def before_forward(self, sampling: list[ScheduledSequence]) -> Callable[[int], None] | None:
        """Called before the forward with the sequences that sample this step; may return
        ``after_layer(i)``, called as soon as layer ``i``'s K/V are written."""
        return None

    def after_forward(self) -> None:
        """Called once the forward (and its logits) are done, before sampling."""

    def after_sample(self, sampling: list[ScheduledSequence],
                     deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Called with one delta per sampling sequence; returns the deltas the step emits."""
        return deltas

    def forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """Called when ``parent``'s request (``n``/``best_of`` > 1) forked into ``children``,
        now tracked, before any of them has made a delta (a streaming worker gives them
        their request's owner)."""
