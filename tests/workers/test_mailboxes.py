"""RouterMailboxes: several routers polling one worker each get their own requests' deltas,
in the order the worker made them; each router has its own orphan clock; nothing is kept
after a request's last delta or once its router is forgotten."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.streaming_worker.mailboxes import MailboxSizes, RouterMailboxes
from pdserve.worker_api import DuplicateRequestId, RequestDelta, StepDeltas


def delta(request_id: str, token: int, last: bool = False, attempt: int = 1) -> RequestDelta:
    return RequestDelta(request_id, [token], "", "length" if last else None, attempt=attempt)


def steps(*items: RequestDelta | StepDeltas) -> StepDeltas:
    out = StepDeltas()
    for item in items:
        out.extend(item if isinstance(item, StepDeltas) else [item])
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_router_gets_its_own_deltas_in_order():
    boxes = RouterMailboxes()
    boxes.claim("a1", 1, "router")
    boxes.claim("b1", 1, "router-1")
    # router-1's poll drains deltas of both: router's wait in its box.
    mine = boxes.sort(steps(delta("a1", 1), delta("b1", 10), delta("a1", 2)), "router-1")
    assert [(d.request_id, d.new_token_ids) for d in mine] == [("b1", [10])]
    later = boxes.sort(steps(delta("a1", 3, last=True)), "router")
    assert [d.new_token_ids for d in steps(boxes.take("router"), later)] == [[1], [2], [3]]
    assert not boxes.take("router") and not boxes.take("router-1")


def test_unclaimed_deltas_go_to_the_poller_and_owners_end_with_the_last_delta():
    boxes = RouterMailboxes()
    assert [d.request_id for d in boxes.sort(steps(delta("x", 1)), "router")] == ["x"]
    boxes.claim("y", 1, "router-1")
    boxes.sort(steps(delta("y", 1, last=True)), "router")
    assert [d.request_id for d in boxes.take("router-1")] == ["y"]
    assert boxes.sizes() == MailboxSizes(num_owned=0, num_boxed=0, num_routers=1)


def test_a_second_claim_of_a_held_id_is_refused_and_the_owner_stays():
    """Ids are the router's, one per attempt: a claim of an id held here (a replay, another
    router) is refused, and the first owner keeps its request and its deltas."""
    boxes = RouterMailboxes()
    boxes.claim("r.1", 1, "router-1")
    with pytest.raises(DuplicateRequestId):
        boxes.claim("r.1", 1, "router-2")
    assert boxes.sizes().num_owned == 1
    assert not boxes.sort(steps(delta("r.1", 5)), "router-2")  # router-1's, left in its box
    assert [d.new_token_ids for d in boxes.take("router-1")] == [[5]]
    boxes.sort(steps(delta("r.1", 0, last=True)), "router-1")
    assert boxes.sizes().num_owned == 0


def test_the_orphan_clock_is_per_router():
    clock = Clock()
    boxes = RouterMailboxes(clock)
    boxes.claim("a1", 1, "router")
    boxes.claim("a2", 1, "router")
    boxes.claim("b1", 1, "router-1")
    boxes.polled("router")
    boxes.sort(steps(delta("a1", 1), delta("b1", 2)), "router-1")  # router-1's poll at t=0
    for t in (1.0, 2.0, 3.0, 3.5):  # router-1 keeps polling, router is silent
        clock.now = t
        boxes.polled("router-1")
        assert [s.router for s in boxes.silent(3.0)] == ([] if t <= 3.0 else ["router"])
    [silent] = boxes.silent(3.0)
    assert sorted(silent.request_ids) == ["a1", "a2"] and silent.silent_s == 3.5
    assert boxes.sizes() == MailboxSizes(num_owned=3, num_boxed=1, num_routers=2)
    boxes.forget("router")
    assert boxes.sizes() == MailboxSizes(num_owned=3, num_boxed=0, num_routers=1)
    assert boxes.silent(3.0) == []
    # the worker fails a1 and a2: their tokens go nowhere, their ends to the poller (which
    # ignores them; "router" itself, polling first, would learn why) and end their entries
    ends = [delta("a1", 7), RequestDelta("a1", [], "", "abort", attempt=1, error="gone"),
            RequestDelta("a2", [], "", "abort", attempt=1, error="gone")]
    assert list(boxes.sort(steps(*ends), "router-1")) == ends[1:]
    assert boxes.sizes() == MailboxSizes(num_owned=1, num_boxed=0, num_routers=1)


def test_a_claim_starts_the_clock_of_a_router_that_never_polled_and_idle_routers_go():
    clock = Clock()
    boxes = RouterMailboxes(clock)
    boxes.claim("a1", 1, "router")  # router reserves, then dies before its first poll
    clock.now = 2.0
    boxes.claim("a2", 1, "router")  # a later claim is no poll: the clock runs on
    clock.now = 3.5
    assert [s.request_ids for s in boxes.silent(3.0)] == [["a1", "a2"]]
    boxes.polled("router-1")  # owns nothing: forgotten once silent, so clocks stay bounded
    clock.now = 7.0
    boxes.forget("router")
    assert boxes.silent(3.0) == [] and boxes.sizes().num_routers == 0


def compact(*pairs: tuple[str, int]) -> StepDeltas:
    """A pure decode step's deltas (columns), texts filled."""
    ids, tokens = [p[0] for p in pairs], [p[1] for p in pairs]
    made = StepDeltas.new_tokens(ids, tokens, [1] * len(ids), np.full(len(ids), 5),
                                 np.arange(len(ids)) + 1)
    made.fill_text(lambda request_id, attempt, token_id: f"t{token_id}", lambda *_: "")
    return made


def test_a_compact_delta_is_split_by_owner():
    boxes = RouterMailboxes()
    boxes.claim("a1", 1, "router")
    boxes.claim("a2", 1, "router")
    boxes.claim("b1", 1, "router-1")
    whole = compact(("a1", 1), ("a2", 2))
    assert list(boxes.sort(whole, "router")) == list(whole)
    mine = boxes.sort(steps(delta("a1", 3), compact(("a1", 4), ("b1", 40), ("a2", 5))),
                      "router-1")
    assert [(d.request_id, d.new_token_ids, d.text) for d in mine] == [("b1", [40], "t40")]
    theirs = list(boxes.take("router"))
    assert [(d.request_id, d.new_token_ids, d.text, d.num_output_tokens) for d in theirs] == [
        ("a1", [3], "", 0), ("a1", [4], "t4", 1), ("a2", [5], "t5", 3)]
