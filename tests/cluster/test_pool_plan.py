"""The pool manager's decision: (target, members) -> actions, without Ray or Redis."""

from __future__ import annotations

import pytest

from pdserve.cluster.pools.plan import (
    DEAD,
    DRAIN,
    DRAINING,
    FINISH,
    READY,
    REMOVE,
    REPLACE,
    START,
    STARTING,
    Action,
    MemberView,
    plan,
)


def kinds(actions: list[Action]) -> list[tuple[str, str | None]]:
    return [(a.kind, a.worker_id) for a in actions]


def test_an_empty_pool_starts_its_target():
    assert kinds(plan("decode", 2, [])) == [(START, None), (START, None)]
    assert all(a.role == "decode" and a.restarts == 0 for a in plan("decode", 2, []))


def test_a_pool_at_its_target_does_nothing():
    members = [MemberView("d0", READY), MemberView("d1", STARTING)]
    assert plan("decode", 2, members) == []


def test_a_dead_worker_is_replaced_and_its_restarts_carried_on():
    members = [MemberView("d0", READY), MemberView("d1", DEAD, restarts=2)]
    assert plan("decode", 2, members) == [Action(REPLACE, "decode", "d1", 3)]


def test_a_dead_worker_beyond_the_target_is_removed_not_replaced():
    members = [MemberView("d0", READY), MemberView("d1", DEAD)]
    assert kinds(plan("decode", 1, members)) == [(REMOVE, "d1")]


def test_a_worker_that_died_while_draining_is_not_replaced():
    members = [MemberView("d0", READY), MemberView("d1", DEAD, was_draining=True)]
    assert kinds(plan("decode", 1, members)) == [(REMOVE, "d1")]
    # even when the pool is short: the drain already lowered the target
    assert kinds(plan("decode", 2, members)) == [(REMOVE, "d1"), (START, None)]


def test_held_starts_keep_the_dead_listed_and_start_nothing():
    members = [MemberView("d0", DEAD)]
    assert plan("decode", 1, members, can_start=False) == []
    assert plan("decode", 2, [], can_start=False) == []


def test_a_drained_worker_is_finished_and_a_draining_one_waits():
    members = [MemberView("d0", READY), MemberView("d1", DRAINING, load=3),
               MemberView("d2", DRAINING, drained=True)]
    assert kinds(plan("decode", 1, members)) == [(FINISH, "d2")]


def test_draining_workers_do_not_count_against_the_target():
    members = [MemberView("d0", DRAINING, load=1)]
    assert kinds(plan("decode", 1, members)) == [(START, None)]


def test_surplus_drains_starting_first_then_least_loaded_newest_first():
    members = [MemberView("d0", READY, load=2), MemberView("d1", READY, load=0),
               MemberView("d2", READY, load=0), MemberView("d3", STARTING)]
    assert kinds(plan("decode", 3, members)) == [(DRAIN, "d3")]
    assert kinds(plan("decode", 1, members)) == [(DRAIN, "d3"), (DRAIN, "d2"), (DRAIN, "d1")]
    assert kinds(plan("decode", 0, members))[-1] == (DRAIN, "d0")


def test_replacements_fill_the_target_before_fresh_starts():
    members = [MemberView("d0", DEAD, restarts=1), MemberView("d1", DEAD)]
    actions = plan("decode", 3, members)
    assert kinds(actions) == [(REPLACE, "d0"), (REPLACE, "d1"), (START, None)]
    assert [a.restarts for a in actions] == [2, 1, 0]


def test_a_negative_target_is_refused():
    with pytest.raises(ValueError, match="target"):
        plan("decode", -1, [])


def test_an_unknown_target_keeps_the_pool_as_it_is():
    """A target nobody knows (Redis lost it) is never read as zero: nothing drains, nothing
    starts beyond the pool's workers, a dead worker's slot is refilled."""
    members = [MemberView("d0", READY, load=0), MemberView("d1", STARTING)]
    assert plan("decode", None, members) == []
    assert plan("decode", None, []) == []
    members += [MemberView("d2", DEAD, restarts=1), MemberView("d3", DEAD, was_draining=True),
                MemberView("d4", DRAINING, drained=True)]
    assert kinds(plan("decode", None, members)) == [(REPLACE, "d2"), (REMOVE, "d3"),
                                                    (FINISH, "d4")]
    assert kinds(plan("decode", None, members, can_start=False)) == [(REMOVE, "d3"),
                                                                     (FINISH, "d4")]
