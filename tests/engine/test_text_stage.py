"""Deferred detokenization (engine/step/text_stage.py): the text is the same, made off the step.

Requests without stop strings get their text when the deltas are read (``engine.render``),
possibly on another thread while the engine steps; requests with stop strings keep it in the
step. Either way the concatenated text equals the inline detokenizer's.
"""

from __future__ import annotations

import threading

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parts import EngineParts
from pdserve.engine.step.detokenizer import Detokenizer
from pdserve.testing.general_steps import general_steps
from pdserve.worker_api import StepDeltas
from pdserve.worker_api.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def parts(tiny_dir):
    return EngineParts.build(EngineConfig(model=str(tiny_dir), num_kv_blocks=256))


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True, **kw)


def _expected_text(parts, prompt_ids: list[int], output_ids: list[int]) -> str:
    detok = Detokenizer(parts.tokenizer, prompt_ids)
    return "".join(detok.append(t).text for t in output_ids) + detok.flush()


def test_the_step_leaves_text_to_render_and_render_fills_it(parts):
    engine = LLMEngine(parts)
    seq = engine.add_request("a", "Hello there, tiny model", _params())
    raw = StepDeltas()
    while engine.has_unfinished_requests():
        raw.extend(engine.step())
    assert all(d.text == "" for d in raw)  # no text made in the step
    assert engine.text.num_deferred == 1
    text = "".join(d.text for d in engine.render(raw))
    assert text and text == _expected_text(parts, seq.prompt_token_ids, seq.output_token_ids)
    assert engine.text.num_deferred == 0  # the final delta closed it


def test_stop_strings_are_detokenized_in_the_step(parts):
    probe = LLMEngine(parts)
    probe.add_request("p", "Hello there, tiny model", _params())
    deltas = StepDeltas()
    while probe.has_unfinished_requests():
        deltas.extend(probe.step())
    full = "".join(d.text for d in probe.render(deltas))
    stop = full[3:6]  # three characters the model will write: the stop string
    engine = LLMEngine(parts)
    engine.add_request("s", "Hello there, tiny model", _params(stop=[stop]))
    deltas = StepDeltas()
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    assert list(deltas)[-1].finish_reason == "stop" and len(deltas) < 12
    assert "".join(d.text for d in deltas) == full[:full.index(stop)]  # no render needed


def test_rendering_on_another_thread_while_stepping(parts):
    engine = LLMEngine(parts)
    prompts = [f"Request number {i} says hello" for i in range(6)]
    seqs = [engine.add_request(f"r{i}", p, _params()) for i, p in enumerate(prompts)]
    batches: list[list] = []
    lock, done = threading.Condition(), threading.Event()
    texts = {s.request_id: "" for s in seqs}

    def reader():
        while True:
            with lock:
                while not batches and not done.is_set():
                    lock.wait(0.05)
                if not batches and done.is_set():
                    return
                batch = batches.pop(0)
            for delta in engine.render(batch):
                texts[delta.request_id] += delta.text

    thread = threading.Thread(target=reader)
    thread.start()
    while engine.has_unfinished_requests():
        deltas = engine.step()
        with lock:
            batches.append(deltas)
            lock.notify()
    done.set()
    thread.join(10)
    for seq in seqs:
        assert texts[seq.request_id] == _expected_text(parts, seq.prompt_token_ids,
                                                       seq.output_token_ids)


def test_abort_drops_deferred_state_and_a_later_attempt_starts_fresh(parts):
    engine = LLMEngine(parts)
    engine.add_request("m", "Hello there", _params())
    engine.step()
    engine.abort("m")
    assert engine.text.num_deferred == 0
    seq = engine.add_request("m", "Hello there", _params())  # same id again
    deltas = StepDeltas()
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    text = "".join(d.text for d in engine.render(deltas))
    assert text == _expected_text(parts, seq.prompt_token_ids, seq.output_token_ids)


def test_offline_llm_text_equals_the_detokenizer(tiny_dir):
    from pdserve.engine.llm import LLM

    llm = LLM(str(tiny_dir), num_kv_blocks=256)
    out = llm.generate(["Hello there", "Another prompt here"], _params(), use_tqdm=False)
    for o in out:
        assert o.text == _expected_text(llm.engine.parts, o.prompt_token_ids, o.token_ids)


def test_offline_llm_reads_column_deltas_as_render_would(tiny_dir):
    """The offline LLM reads a pure decode step's tokens from their columns (``read``, no
    RequestDelta per token): its outputs equal an engine's whose every step is general."""
    from pdserve.engine.llm import LLM

    prompts = ["Hello there", "Another prompt here", "A third"]
    params = [_params(), SamplingParams(max_tokens=20, temperature=0.8, seed=3),
              SamplingParams(max_tokens=15, temperature=0.0)]
    llm, reference = LLM(str(tiny_dir), num_kv_blocks=256), LLM(str(tiny_dir), num_kv_blocks=256)
    general_steps(reference.engine.scheduler.policy)  # its every step general
    calls = []
    read = StepDeltas.read

    def counting_read(deltas, token, delta):
        read(deltas, lambda *args: calls.append(1) or token(*args), delta)

    StepDeltas.read = counting_read
    def outputs(engine_llm):
        return [(o.token_ids, o.text, o.finish_reason, o.first_token_time is not None)
                for o in engine_llm.generate(prompts, params, use_tqdm=False)]

    try:
        assert outputs(llm) == outputs(reference)
    finally:
        StepDeltas.read = read
    assert sum(calls) > 20  # most tokens came as columns
