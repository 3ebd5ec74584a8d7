"""StepDeltas: whatever the encoding, readers get one RequestDelta per request per step, in the
order made; text filling, splitting by owner and pickling keep that."""

from __future__ import annotations

import pickle

import numpy as np

from pdserve.worker_api import RequestDelta, StepDeltas


def new_tokens(*pairs: tuple[str, int]) -> StepDeltas:
    ids, tokens = [p[0] for p in pairs], [p[1] for p in pairs]
    return StepDeltas.new_tokens(ids, tokens, [2] * len(ids), np.full(len(ids), 4),
                                 np.arange(len(ids)) + 1)


def mixed() -> StepDeltas:
    deltas = StepDeltas([RequestDelta("a", [7], "x", attempt=1)])
    deltas.extend(new_tokens(("b", 1), ("c", 2)))
    deltas.append(RequestDelta("b", [3, 4], "", "stop", attempt=2))
    return deltas


def summary(deltas) -> list[tuple]:
    return [(d.request_id, d.new_token_ids, d.text, d.finish_reason, d.attempt,
             d.num_prompt_tokens, d.num_output_tokens) for d in deltas]


def test_columns_read_as_one_request_delta_each_in_order():
    deltas = mixed()
    assert len(deltas) == 4 and bool(deltas) and not StepDeltas() and not new_tokens()
    assert summary(deltas) == [("a", [7], "x", None, 1, 0, 0), ("b", [1], "", None, 2, 4, 1),
                               ("c", [2], "", None, 2, 4, 2), ("b", [3, 4], "", "stop", 2, 0, 0)]


def test_fill_text_adds_each_token_and_ends_final_deltas():
    deltas = mixed()
    deltas.fill_text(lambda request_id, attempt, token_id: f"{request_id}{token_id}",
                     lambda request_id, attempt: f"|{request_id}{attempt}")
    assert [d.text for d in deltas] == ["xa7", "b1", "c2", "b3b4|b2"]


def test_read_gives_columns_as_tokens_and_the_rest_as_deltas():
    deltas, seen = mixed(), []
    deltas.read(lambda request_id, token_id, text: seen.append((request_id, token_id, text)),
                lambda delta: seen.append(delta.request_id))
    assert seen == ["a", ("b", 1, ""), ("c", 2, ""), "b"]


def test_split_keeps_each_owners_order_and_drops_none():
    deltas = mixed()
    deltas.extend(new_tokens(("a", 5), ("c", 6)))
    calls = []

    def owner(request_id, attempt, final):
        calls.append((request_id, final))
        return None if request_id == "c" else request_id.upper()

    shares = deltas.split(owner)
    assert calls == [("a", False), ("b", False), ("c", False), ("b", True), ("a", False),
                     ("c", False)]
    assert {k: [(d.request_id, d.new_token_ids) for d in v] for k, v in shares.items()} == {
        "A": [("a", [7]), ("a", [5])], "B": [("b", [1]), ("b", [3, 4])]}
    assert len(shares["A"]) == 2 and len(shares["B"]) == 2


def test_one_owner_keeps_the_columns_whole():
    """A step's columns owned by one router ship as they came (no object per request)."""
    step = new_tokens(*[(f"r{i}", i) for i in range(64)])
    share = step.split(lambda *_: "router")["router"]
    assert summary(share) == summary(step)
    assert len(pickle.dumps(share)) == len(pickle.dumps(step))
    expanded = StepDeltas(step)
    assert len(pickle.dumps(expanded)) > 2 * len(pickle.dumps(step))


def test_pickled_deltas_read_the_same():
    deltas = mixed()
    deltas.fill_text(lambda *_: "t", lambda *_: "")
    assert summary(pickle.loads(pickle.dumps(deltas))) == summary(deltas)
