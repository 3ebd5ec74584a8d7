"""Prefill and decode workers compile a request's grammar off their engine loop
(``LLMEngine.then_prepared``): a compile held up by a test hook leaves other requests'
reservations, prefills and tokens going, the held request goes on once its grammar is ready,
and a constraint that cannot be served fails that request alone."""

from __future__ import annotations

import re
import threading
import time

import pytest

from pdserve import SamplingParams
from pdserve.engine.sampling.grammar import GrammarCompiler
from pdserve.worker_api import NeverFits, WorkRequest

REGEX = "[a-c]{3}-[0-9]{2}"
FREE = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONSTRAINED = SamplingParams(max_tokens=20, temperature=0.0,
                             structured_outputs={"regex": REGEX})


@pytest.fixture
def gate(monkeypatch):
    """Every compile waits until ``gate.open`` is set; ``gate.threads`` names where they ran."""
    original = GrammarCompiler.constraint

    class Gate:
        open = threading.Event()
        entered = threading.Event()
        threads: list[str] = []

    def gated(self, outputs):
        Gate.threads.append(threading.current_thread().name)
        Gate.entered.set()
        assert Gate.open.wait(60), "the test never opened the gate"
        return original(self, outputs)

    monkeypatch.setattr(GrammarCompiler, "constraint", gated)
    yield Gate
    Gate.open.set()


def _request(request_id: str, params: SamplingParams) -> WorkRequest:
    return WorkRequest(request_id, [5, 6, 7, 8], params, seed=7, arrival_time=time.time())


def _decoded(pair, request_id: str, first) -> list[int]:
    tokens, reason = pair.follow(request_id, first)
    assert reason == "stop", reason
    return tokens


def test_a_slow_compile_holds_no_step_on_either_worker(hf_checkpoint, make_pair, gate):
    pair = make_pair(hf_checkpoint("llama"))
    held = _request("held", CONSTRAINED)
    reserving = pair.decode.reserve(held)
    assert gate.entered.wait(60)
    # the decode worker's loop is free: another request reserves, prefills and decodes
    tokens, reason = pair.generate("free-1", [9, 10, 11], FREE, timeout=30)
    assert (len(tokens), reason) == (6, "length")
    assert not reserving.done()
    gate.open.set()
    reservation = reserving.result(30)

    gate.open.clear()
    gate.entered.clear()
    prefilling = pair.prefill.prefill(held, reservation)  # its engine compiles its own
    assert gate.entered.wait(60)
    tokens, reason = pair.generate("free-2", [12, 13], FREE, timeout=30)
    assert (len(tokens), reason) == (6, "length")
    assert not prefilling.done()
    gate.open.set()
    result = prefilling.result(30)
    first = result.first
    # each worker's compile, for the request's trace; a free request has none
    assert reservation.grammar_cache_hit is False and reservation.grammar_compile_s >= 0
    assert result.grammar_cache_hit is False and result.grammar_compile_s >= 0
    assert pair.last[0].grammar_compile_s is None and pair.last[1].grammar_compile_s is None
    text = pair.decode.engine.parts.tokenizer.decode(_decoded(pair, "held", first))
    assert re.fullmatch(REGEX, text), text
    assert gate.threads and all(name.startswith("pdserve-grammar") for name in gate.threads)
    assert pair.used_blocks() == (0, 0)


def test_a_constraint_that_does_not_compile_fails_that_request_alone(hf_checkpoint,
                                                                      make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    bad = SamplingParams(max_tokens=5, structured_outputs={"grammar": "root ::= ("})
    for call in (lambda r: pair.decode.reserve(r),
                 lambda r: pair.prefill.prefill(r, None)):
        with pytest.raises(NeverFits, match="structured_outputs.grammar does not compile"):
            call(_request("bad", bad)).result(60)
    tokens, reason = pair.generate("after", [3, 4], FREE, timeout=30)
    assert (len(tokens), reason) == (6, "length")
    assert pair.used_blocks() == (0, 0)


def test_an_abort_while_the_grammar_compiles_leaves_no_reservation(hf_checkpoint, make_pair,
                                                                    gate):
    """The router gave the attempt up (a timeout) and aborted it before its grammar was
    ready: once the grammar is, the reservation is refused instead of holding blocks until
    its lease ends."""
    pair = make_pair(hf_checkpoint("llama"))
    reserving = pair.decode.reserve(_request("late", CONSTRAINED))
    assert gate.entered.wait(60)
    pair.decode.abort("late").result(30)
    gate.open.set()
    with pytest.raises(RuntimeError, match="aborted while its grammar compiled"):
        reserving.result(30)
    assert pair.used_blocks() == (0, 0)
    tokens, reason = pair.generate("next", [3, 4], FREE, timeout=30)  # the worker goes on
    assert (len(tokens), reason) == (6, "length")
