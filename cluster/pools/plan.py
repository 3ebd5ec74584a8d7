"""The pool manager's decision: (target, members) -> actions, a pure function.

:func:`plan` knows nothing of Ray or Redis; ``pdserve.cluster.pools.manager`` observes the members,
calls it once per pool per reconcile and performs the actions.
"""

from __future__ import annotations

from dataclasses import dataclass

STARTING, READY, DRAINING, DEAD = "starting", "ready", "draining", "dead"
START, REPLACE, REMOVE, DRAIN, FINISH = "start", "replace", "remove", "drain", "finish"
MAX_WORKERS_PER_POOL = 64  # the default ceiling of one pool's target (--max-workers-per-pool)


@dataclass(frozen=True)
class MemberView:
    """What :func:`plan` knows about one member of a pool."""

    worker_id: str
    state: str  # STARTING | READY | DRAINING | DEAD
    load: int = 0  # running + waiting requests in its latest heartbeat
    drained: bool = False  # DRAINING and done: idle after the grace, or its drain timed out
    was_draining: bool = False  # DEAD while draining: its slot is not refilled
    restarts: int = 0  # restarts of its slot so far


@dataclass(frozen=True)
class Action:
    kind: str  # START | REPLACE | REMOVE | DRAIN | FINISH
    role: str
    worker_id: str | None = None  # the member acted on (None for START)
    restarts: int = 0  # START / REPLACE: the new worker's restart count


def plan(role: str, target: int | None, members: list[MemberView],
         can_start: bool = True) -> list[Action]:
    """The actions that bring one pool to ``target`` (members in start order).

    Starting and ready members count against the target. A dead member is replaced while the
    pool is short of its target (a restart), otherwise removed; while starts are held
    (``can_start`` false, after failed starts) it stays listed as dead. A pool above its
    target drains its surplus: starting members first, then the least loaded, newest first.
    An unknown target (None: nobody knows it, e.g. Redis lost it) keeps the pool as it is:
    every slot with a worker that did not drain keeps one, nothing starts beyond, nothing
    drains; a missing target is never a target of zero.
    """
    if target is None:
        target = sum(m.state in (STARTING, READY) or (m.state == DEAD and not m.was_draining)
                     for m in members)
    if target < 0:
        raise ValueError(f"target must be >= 0, got {target}")
    active = [m for m in members if m.state in (STARTING, READY)]
    missing = target - len(active)
    actions = []
    for m in members:
        if m.state == DEAD:
            if m.was_draining or missing <= 0:
                actions.append(Action(REMOVE, role, m.worker_id))
            elif can_start:
                actions.append(Action(REPLACE, role, m.worker_id, m.restarts + 1))
                missing -= 1
        elif m.state == DRAINING and m.drained:
            actions.append(Action(FINISH, role, m.worker_id))
    if missing > 0 and can_start:
        actions += [Action(START, role) for _ in range(missing)]
    elif missing < 0:
        order = sorted(enumerate(active), key=lambda im: (im[1].state != STARTING, im[1].load,
                                                          -im[0]))
        actions += [Action(DRAIN, role, m.worker_id) for _, m in order[:-missing]]
    return actions
