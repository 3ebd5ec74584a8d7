"""Structured output in the engine (engine/sampling/grammar.py): the built-in tiny model has
random weights, so whatever it writes under a constraint matches it only because the grammar's
token mask allowed nothing else. Greedy under a JSON schema equals a Hugging Face greedy loop
with the same mask; unconstrained rows in the same batch get the tokens they get alone; a
request resumed elsewhere (its outputs replayed into a fresh matcher) goes on where it was."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker_api import NeverFits, WorkRequest
from pdserve.worker_api.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
    "code": {"type": "string", "pattern": "^[a-c]{2}[0-9]$"}},
    "required": ["color", "ok", "code"], "additionalProperties": False}
REGEX = "[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe not"]
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [40, 41], [77, 3, 9, 100, 4]]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4) as engine:
        yield engine


def constrained(outputs: dict, temperature: float = 0.0, seed: int | None = None,
                max_tokens: int = 60) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=outputs)


def test_structured_outputs_are_checked_when_built():
    assert StructuredOutputs.of({"json": SCHEMA}).json == json.dumps(SCHEMA, sort_keys=True)
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice \
        == ("a", "b")
    bad = [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
           ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
           ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema"),
           ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
           ({"grammar": "x" * 70000}, "structured_outputs.grammar must be at most"),
           ({"choice": []}, "structured_outputs.choice must be a list of non-empty strings"),
           ({"choice": ["a"] * 300}, "structured_outputs.choice must hold at most"),
           ({"json_object": 1}, "structured_outputs.json_object must be a bool"),
           ({"jsn": "{}"}, "unknown fields ['jsn']")]
    for value, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(structured_outputs=value)
    with pytest.raises(ValueError, match="structured_outputs must be an object"):
        SamplingParams(structured_outputs="json")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_match_their_constraint_whatever_the_model_prefers(llm, temperature):
    kinds = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}]
    params = [constrained(kind, temperature, seed=i) for i, kind in enumerate(kinds * 2)]
    prompts = (PROMPTS * 2)[:len(params)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        assert out.finish_reason == "stop", (out.text, p.structured_outputs)
        kind = p.structured_outputs.kind
        if kind == "json":
            value = json.loads(out.text)
            assert set(value) == {"color", "ok", "code"} and value["color"] in \
                ("red", "green", "blue") and isinstance(value["ok"], bool)
            assert re.fullmatch("[a-c]{2}[0-9]", value["code"])
        elif kind == "regex":
            assert re.fullmatch(REGEX, out.text), out.text
        else:
            assert out.text in CHOICES
    free = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert not re.fullmatch(REGEX, free.text)  # (the model alone writes none of these)


def test_unconstrained_rows_beside_constrained_ones_get_their_own_tokens(llm):
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], free, use_tqdm=False)[0].token_ids
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                         [constrained({"json": SCHEMA}), free, constrained({"regex": REGEX})],
                         use_tqdm=False)
    assert mixed[1].token_ids == alone
    assert json.loads(mixed[0].text) and re.fullmatch(REGEX, mixed[2].text)


def test_greedy_under_a_schema_equals_a_hugging_face_loop_with_the_same_mask(llm, tiny_dir):
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    engine: LLMEngine = llm.engine
    params = constrained({"json": SCHEMA})
    ours = llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    constraint = engine._constraint(params)  # a fresh matcher at the grammar's start
    vocab = engine.parts.model_config.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids, theirs = list(PROMPTS[3]), []
    with torch.no_grad():
        while not constraint.is_terminated and len(theirs) < params.max_tokens:
            logits = model(torch.tensor([ids])).logits[:, -1, :].float()
            constraint.matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
            token = int(logits.argmax())
            assert constraint.accept(token)
            ids.append(token)
            theirs.append(token)
    assert ours.token_ids == theirs and ours.finish_reason == "stop"


def test_a_resumed_request_goes_on_where_it_was_and_refuses_outputs_off_its_grammar(llm):
    engine: LLMEngine = llm.engine
    params = constrained({"json": SCHEMA})
    whole = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].token_ids
    assert len(whole) > 6
    cut = len(whole) // 2
    engine.add_work(WorkRequest("resumed", list(PROMPTS[2]), params, seed=0, arrival_time=0.0,
                                output_token_ids=whole[:cut]))
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.render(engine.step()):
            tokens += delta.new_token_ids
    assert tokens == whole[cut:]
    probe = engine._constraint(params)  # the grammar after whole[:cut - 1]: find a token
    assert all(map(probe.accept, whole[:cut - 1]))  # it forbids there
    refused = next(t for t in range(engine.parts.model_config.vocab_size) if not probe.accept(t))
    off = whole[:cut - 1] + [refused]
    with pytest.raises(NeverFits, match=r"output_token_ids\[\d+\] .* structured_outputs"):
        engine.sequence_for(WorkRequest("off", list(PROMPTS[2]), params, seed=0,
                                        arrival_time=0.0, output_token_ids=off))


@pytest.mark.parametrize("outputs,field", [({"json": {"type": "object", "properties": {
    "a": {"$ref": "#/$defs/missing"}}}}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar")])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(llm, outputs, field):
    with pytest.raises(NeverFits, match=re.escape(field) + " does not compile"):
        llm.engine.add_request("bad", PROMPTS[0], constrained(outputs))
    assert not llm.engine.has_unfinished_requests()


def test_int8_kv_checks_its_logits_before_the_grammar_masks_them(tiny_dir):
    """The int8 KV cache fails a row whose logits are not finite; the grammar's -inf are not
    that, so they go in after the check."""
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4, kv_cache_dtype="int8") as int8:
        outs = int8.generate(PROMPTS[:2], [constrained({"regex": REGEX}),
                                           constrained({"regex": REGEX}, temperature=1.0)],
                             use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_a_constraint_is_exact(llm, tiny_dir, method):
    """Drafts are verified against the grammar at each position: greedy output equals the
    engine without speculation, drafts were proposed and some refused, and sampled outputs
    match."""
    kinds = [{"json": SCHEMA}, {"regex": "(ab|cd|ef){12}"}, {"choice": CHOICES}]
    greedy = [constrained(kind) for kind in kinds]
    sampled = [constrained(kind, temperature=1.0, seed=i) for i, kind in enumerate(kinds)]
    expected = [out.token_ids for out in llm.generate(PROMPTS[:3], greedy, use_tqdm=False)]
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = str(tiny_dir)
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4,
             speculative_config=config) as speculating:
        outs = speculating.generate(PROMPTS[:3], greedy, use_tqdm=False)
        assert [out.token_ids for out in outs] == expected
        for out, p in zip(speculating.generate(PROMPTS[:3], sampled, use_tqdm=False), sampled,
                          strict=True):
            assert out.finish_reason == "stop"
            if p.structured_outputs.kind == "json":
                assert set(json.loads(out.text)) == {"color", "ok", "code"}
            elif p.structured_outputs.kind == "regex":
                assert re.fullmatch("(ab|cd|ef){12}", out.text), out.text
            else:
                assert out.text in CHOICES
        stats = speculating.engine.speculator.stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens
        # the draft model (the model itself) drafts its unconstrained argmax, which the
        # grammar refuses nearly everywhere; prompt lookup drafts the pattern, often allowed
        assert stats.num_accepted_tokens > 0 or method == "draft_model"


def test_constraints_made_on_many_threads_at_once_each_follow_their_own_grammar(
        tiny_dir, monkeypatch):
    """A colocated worker checks requests on its callers' threads while the loop steps: the
    grammar engine is made once and its cache holds under eviction (kept small here)."""
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.engine.sampling import grammar

    monkeypatch.setattr(grammar, "CACHED_GRAMMARS", 2)
    with LLM(str(tiny_dir), num_kv_blocks=64) as fresh:
        engine: LLMEngine = fresh.engine
        regexes = [f"x{i}[a-c]" for i in range(12)] * 3

        def make(regex):
            return engine._constraint(constrained({"regex": regex}))

        with ThreadPoolExecutor(6) as pool:
            made = list(pool.map(make, regexes))
        x = engine.parts.tokenizer.encode("x", add_special_tokens=False)
        for regex, constraint in zip(regexes, made, strict=True):
            assert constraint.accept(x[0]), regex  # every grammar starts with "x"
        assert len(engine._grammars._grammars) <= 2


SUMS = 'root ::= "(" sum ")"\nsum ::= digit | digit "+" digit | digit "+" digit "+" digit\n' \
       'digit ::= [0-9]'


@pytest.mark.parametrize("outputs, check", [
    ({"choice": CHOICES}, lambda text: text in CHOICES),
    ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    ({"grammar": SUMS}, lambda text: re.fullmatch(r"\(\d(\+\d){0,2}\)", text))])
def test_two_hundred_sampled_outputs_each_match(llm, outputs, check):
    params = [constrained(outputs, temperature=1.0, seed=seed, max_tokens=40)
              for seed in range(200)]
    prompts = [PROMPTS[seed % len(PROMPTS)] for seed in range(200)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [out.finish_reason for out in outs] == ["stop"] * 200
    wrong = [out.text for out in outs if not check(out.text)]
    assert wrong == []
    assert len({out.text for out in outs}) > 2  # sampled, not one answer 200 times


SKY = {"type": "object", "properties": {"sky": {"enum": ["clear", "rain"]}},
       "required": ["sky"], "additionalProperties": False}
TAGGED = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<w>"], "at_least_one": True,
    "stop_after_first": True,
    "tags": [{"begin": "<w>", "content": {"type": "json_schema", "json_schema": SKY},
              "end": "</w>"}]}}
OLDER_TAGGED = {"structures": [{"begin": "<w>", "schema": SKY, "end": "</w>"}],
                "triggers": ["<w>"]}


@pytest.mark.parametrize("tag", [TAGGED, OLDER_TAGGED, json.dumps(OLDER_TAGGED)])
def test_a_structural_tag_frees_the_text_and_holds_its_regions(llm, tag):
    """Text is free until a trigger; from there the region must match its schema and end."""
    params = constrained({"structural_tag": tag})
    assert json.loads(params.structured_outputs.structural_tag)  # kept as canonical JSON
    free = "" if tag is TAGGED else "any words "  # (at_least_one: a tag comes first)
    probe = llm.engine._constraint(params).matcher
    assert probe.accept_string(free + '<w>{"sky":"rain"}</w>')
    refused = llm.engine._constraint(params).matcher
    assert refused.accept_string(free + "<w>") and not refused.accept_string('{"sky":"snow"')


def test_a_tag_that_must_appear_appears_whole_in_sampled_outputs(llm):
    params = [constrained({"structural_tag": TAGGED}, temperature=1.0, seed=seed,
                          max_tokens=80) for seed in range(8)]
    for out in llm.generate(PROMPTS * 2, params, use_tqdm=False):
        assert out.finish_reason == "stop", out.text
        region = re.search(r"<w>(.*)</w>", out.text, re.DOTALL)
        assert region and json.loads(region.group(1))["sky"] in ("clear", "rain"), out.text


def test_a_structural_tag_that_is_not_an_object_or_does_not_compile_is_refused(llm):
    with pytest.raises(ValueError, match="structured_outputs.structural_tag must be an object"):
        SamplingParams(structured_outputs={"structural_tag": "[1]"})
    with pytest.raises(NeverFits, match="structured_outputs.structural_tag does not compile"):
        llm.engine.add_request("bad", PROMPTS[0], constrained(
            {"structural_tag": {"structures": [{"begin": "<w>"}], "triggers": ["<w>"]}}))


def test_a_constraint_holds_with_chunked_prefill_a_prefix_hit_and_stop_strings(llm, tiny_dir):
    """A long prompt prefilled in chunks of 8 tokens, then again from the prefix cache: the
    same constrained greedy output as in one chunk; a stop string cuts a constrained answer
    where it appears (finish_reason stop, the text before it)."""
    long_prompt = [(11 * i) % 300 + 3 for i in range(45)]
    params = constrained({"json": SCHEMA})
    whole = llm.generate([long_prompt], params, use_tqdm=False)[0]
    with LLM(str(tiny_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8,
             enable_prefix_caching=True) as chunked:
        first, again = (chunked.generate([long_prompt], params, use_tqdm=False)[0]
                        for _ in range(2))
    assert again.num_cached_tokens > 0
    assert first.token_ids == again.token_ids == whole.token_ids
    cut = whole.text.index('"ok"')  # a stop string inside the JSON
    stopped = llm.generate([long_prompt], SamplingParams(
        max_tokens=60, temperature=0.0, stop=['"ok"'], structured_outputs={"json": SCHEMA}),
        use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.text == whole.text[:cut]
