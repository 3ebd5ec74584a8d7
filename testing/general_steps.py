"""An engine whose decodes are never the runner's persistent rows: every sequence of every step
is a chunk built for that step, the reference the rows are checked and measured against.

The engine puts decodes on the rows whenever its scheduling policy does
(``SchedulingPolicy.decodes_on_rows``) and nothing speculates. A policy with that attribute
off schedules the same tokens, blocks and order, with each decode a one-token
:class:`~pdserve.engine.step.scheduler_output.ScheduledSequence`: what the rows must equal.
"""

from __future__ import annotations

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.step.scheduling_policy import SchedulingPolicy


def general_steps(policy: SchedulingPolicy | None = None) -> SchedulingPolicy:
    """``policy`` (a new default one when None), with no decode on the rows."""
    policy = policy if policy is not None else SchedulingPolicy()
    policy.decodes_on_rows = False
    return policy


def engine(parts: EngineParts, rows: bool = True,
           policy: SchedulingPolicy | None = None, **kwargs) -> LLMEngine:
    """An engine over ``parts``; ``rows`` False: every sequence a chunk, every step."""
    return LLMEngine(parts, policy=policy if rows else general_steps(policy), **kwargs)
