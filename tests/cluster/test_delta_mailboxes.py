"""DeltaMailboxes: several routers polling one worker each get their own requests' deltas,
in the order the worker made them, and nothing is kept after a request's last delta."""

from __future__ import annotations

import numpy as np

from pdserve.cluster.actors import DeltaMailboxes
from pdserve.engine.messages import RequestDelta, TokenDeltas, expand_deltas


def delta(request_id: str, token: int, last: bool = False) -> RequestDelta:
    return RequestDelta(request_id, [token], "", "length" if last else None)


def test_each_router_gets_its_own_deltas_in_order():
    boxes = DeltaMailboxes()
    boxes.own("a1", "router")
    boxes.own("b1", "router-1")
    # router-1's poll drains deltas of both: router's wait in its box.
    mine = boxes.sort([delta("a1", 1), delta("b1", 10), delta("a1", 2)], "router-1")
    assert [(d.request_id, d.new_token_ids) for d in mine] == [("b1", [10])]
    later = boxes.sort([delta("a1", 3, last=True)], "router")
    assert [d.new_token_ids for d in boxes.take("router") + later] == [[1], [2], [3]]
    assert boxes.take("router") == [] and boxes.take("router-1") == []


def test_unclaimed_deltas_go_to_the_poller_and_owners_end_with_the_last_delta():
    boxes = DeltaMailboxes()
    assert [d.request_id for d in boxes.sort([delta("x", 1)], "router")] == ["x"]
    boxes.own("y", "router-1")
    boxes.sort([delta("y", 1, last=True)], "router")
    assert [d.request_id for d in boxes.take("router-1")] == ["y"]
    assert boxes._owners == {}


def compact(*pairs: tuple[str, int]) -> TokenDeltas:
    ids, tokens = [p[0] for p in pairs], [p[1] for p in pairs]
    return TokenDeltas(ids, tokens, [1] * len(ids), np.full(len(ids), 5),
                       np.arange(len(ids)) + 1, [f"t{t}" for t in tokens])


def test_a_compact_delta_is_split_by_owner_and_kept_whole_for_one():
    boxes = DeltaMailboxes()
    boxes.own("a1", "router")
    boxes.own("a2", "router")
    boxes.own("b1", "router-1")
    whole = compact(("a1", 1), ("a2", 2))
    assert boxes.sort([whole], "router") == [whole]  # one owner: the same object
    mine = boxes.sort([delta("a1", 3), compact(("a1", 4), ("b1", 40), ("a2", 5))], "router-1")
    assert [(d.request_id, d.new_token_ids, d.text) for d in expand_deltas(mine)] == [
        ("b1", [40], "t40")]
    theirs = expand_deltas(boxes.take("router"))
    assert [(d.request_id, d.new_token_ids, d.text, d.num_output_tokens) for d in theirs] == [
        ("a1", [3], "", 0), ("a1", [4], "t4", 1), ("a2", [5], "t5", 3)]
