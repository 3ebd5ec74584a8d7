"""An engine whose every step takes the general path, the reference the persistent decode rows
are checked and measured against.

The engine runs a pure decode step on the rows whenever its scheduling policy asks for them
(``SchedulingPolicy.pure_decode_steps``) and nothing speculates. A policy with that attribute
off schedules such a step as any other, one
:class:`~pdserve.engine.step.scheduler_output.ScheduledSequence` per sequence, with the same
tokens, blocks and order: what the rows must equal.
"""

from __future__ import annotations

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.step.scheduling_policy import SchedulingPolicy


def general_steps(policy: SchedulingPolicy | None = None) -> SchedulingPolicy:
    """``policy`` (a new default one when None), asking for no pure decode step."""
    policy = policy if policy is not None else SchedulingPolicy()
    policy.pure_decode_steps = False
    return policy


def engine(parts: EngineParts, rows: bool = True,
           policy: SchedulingPolicy | None = None, **kwargs) -> LLMEngine:
    """An engine over ``parts``; ``rows`` False: on general steps only."""
    return LLMEngine(parts, policy=policy if rows else general_steps(policy), **kwargs)
