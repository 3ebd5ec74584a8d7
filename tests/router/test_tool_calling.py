"""Tool calling's pieces (router/tool_calling.py): the request's tools checked with errors
that name the parameter, the grammar that forces ``required`` and a named function, each
family's parser, and the stream of deltas that holds a call back until it reads whole."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.models.chat_template import ChatTemplate
from pdserve.router.errors import RequestValidationError
from pdserve.router.tool_calling import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedCall,
    ToolCallStream,
    message,
    parser_for,
    template_tool_calls,
    tool_calling_of,
)
from pdserve.testing.chat_templates import CHATML, CHATML_WITH_TOOLS

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def calling(choice=None, parallel=None, parser=None, tools=TOOLS):
    return tool_calling_of(tools, choice, parallel, parser or HermesParser())


@pytest.mark.parametrize("tools, choice, param, message", [
    ("x", None, "tools", "must be a list"),
    ([{"type": "function"}] * 129, None, "tools", "at most 128 tools"),
    ([{"type": "retrieval"}], None, "tools[0].type", "only tools of type 'function'"),
    ([{"type": "function", "function": "f"}], None, "tools[0].function", "must be an object"),
    ([{"function": {"name": "a b"}}], None, "tools[0].function.name", "1-64 letters"),
    ([{"function": {"name": "x" * 65}}], None, "tools[0].function.name", "1-64 letters"),
    ([{"function": {"name": 2**63}}], None, "tools[0].function.name", "1-64 letters"),
    ([{"function": {"name": "f", "parameters": [1]}}], None, "tools[0].function.parameters",
     "JSON schema"),
    ([{"function": {"name": "f", "description": 1e30}}], None,
     "tools[0].function.description", "must be a string"),
    ([{"function": {"name": "f"}}, {"function": {"name": "f"}}], None, "tools",
     "'f' is given twice"),
    (TOOLS, "sometimes", "tool_choice", "must be one of none, auto, required"),
    (TOOLS, 0, "tool_choice", "must be a string or"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name",
     "'nope' is not one of the request's tools"),
    (TOOLS, {"type": "function"}, "tool_choice.function.name", "not one of"),
    (None, "required", "tool_choice", "needs tools"),
    ([], {"type": "function", "function": {"name": "f"}}, "tool_choice", "needs tools"),
])
def test_bad_tools_are_refused_naming_the_parameter(tools, choice, param, message):
    with pytest.raises(RequestValidationError, match=re.escape(message)) as err:
        tool_calling_of(tools, choice, None, HermesParser())
    assert err.value.field == param


def test_auto_needs_a_parser_but_forced_choices_do_not():
    with pytest.raises(RequestValidationError, match="--tool-call-parser") as err:
        tool_calling_of(TOOLS, "auto", None, None)
    assert err.value.field == "tool_choice"
    assert tool_calling_of(TOOLS, "required", None, None).forced
    assert tool_calling_of(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                           None, None).function == "get_time"
    assert tool_calling_of(None, "none", None, None) is None
    assert tool_calling_of(TOOLS, "none", None, None).template_tools is None
    shown = calling().template_tools
    assert [t["function"]["name"] for t in shown] == ["get_weather", "get_time"]
    assert shown[1]["function"]["parameters"] == {"type": "object"}


def test_forced_choices_make_schemas_that_hold_exactly_the_calls():
    named = calling({"type": "function", "function": {"name": "get_weather"}})
    assert named.structured_outputs() == {"json": WEATHER}
    assert calling("auto").structured_outputs() is None
    schema = calling("required").structured_outputs()["json"]
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {"unit": "C"}}],
                  [{"name": "other", "parameters": {}}], {"name": "get_time"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = calling("required", parallel=False).structured_outputs()["json"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)


HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Oslo"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}'
               '</tool_call>')


@pytest.mark.parametrize("parser, text, content, calls", [
    (HermesParser(), HERMES_TEXT, "Let me look.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (HermesParser(), '<tool_call>{"name": "get_time", "arguments": {}}', None,
     [("get_time", {})]),  # cut before its close tag, the JSON still whole
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_time", "parameters": {}}; '
     '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    (MistralParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     None, [("get_weather", {"city": "Oslo"})]),
    (MistralParser(), '[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
    (MistralParser(), 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
     '[TOOL_CALLS]get_time[ARGS]{}', "Sure.", [("get_weather", {"city": "Oslo"}),
                                                ("get_time", {})]),
])
def test_each_family_s_calls_are_read(parser, text, content, calls):
    got_content, got = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), "no call here"),
    (HermesParser(), '<tool_call>{"name": "get_time", "arguments": '),
    (HermesParser(), '<tool_call>{"arguments": {}}</tool_call>'),
    (HermesParser(), '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    (Llama3JsonParser(), 'Hello {"name": "get_time"}'),
    (Llama3JsonParser(), '{"name": "get_time", "parameters": {}} and then words'),
    (MistralParser(), "[not json"),
    (MistralParser(), "[TOOL_CALLS]get_time[ARGS]{oops"),
])
def test_what_does_not_read_whole_is_no_call(parser, text):
    assert parser.parse(text) is None


def test_the_parser_follows_the_setting_or_the_template():
    assert parser_for("auto", CHATML_WITH_TOOLS).name == "hermes"
    assert parser_for("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for("auto", "{% if m.role == 'ipython' %}").name == "llama3_json"
    assert parser_for("auto", CHATML) is None and parser_for("auto", None) is None
    assert parser_for("mistral", CHATML_WITH_TOOLS).name == "mistral"
    assert parser_for("none", CHATML_WITH_TOOLS) is None
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, none, hermes"):
        parser_for("qwen", None)


def test_whole_answers():
    auto = calling()
    answer, reason = message(auto, HERMES_TEXT)
    assert reason == "tool_calls" and answer["content"] == "Let me look."
    assert [(c["type"], c["function"]["name"]) for c in answer["tool_calls"]] == \
        [("function", "get_weather"), ("function", "get_time")]
    assert all(c["id"].startswith("call_") for c in answer["tool_calls"])
    assert len({c["id"] for c in answer["tool_calls"]}) == 2
    answer, reason = message(calling(parallel=False), HERMES_TEXT)
    assert [c["function"]["name"] for c in answer["tool_calls"]] == ["get_weather"]
    unknown = HERMES_TEXT.replace("get_time", "launch")  # not a tool of the request: text
    assert message(auto, unknown) == ({"role": "assistant", "content": unknown}, None)
    assert message(auto, "plain") == ({"role": "assistant", "content": "plain"}, None)
    named = calling({"type": "function", "function": {"name": "get_weather"}})
    answer, reason = message(named, '{"city":"Oslo"}')
    assert reason is None and answer["content"] is None
    assert answer["tool_calls"][0]["function"] == {"name": "get_weather",
                                                   "arguments": '{"city":"Oslo"}'}
    answer, reason = message(calling("required"),
                             '[{"name":"get_time","parameters":{}}]')
    assert reason == "tool_calls" and answer["tool_calls"][0]["function"] == {
        "name": "get_time", "arguments": "{}"}


def _stream(calling_, pieces):
    stream = ToolCallStream(calling_)
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.end()
    return deltas, stream.finish_reason


def _split(text, sizes=(1, 3, 2, 7)):
    pieces, i, k = [], 0, 0
    while i < len(text):
        pieces.append(text[i:i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return pieces


@pytest.mark.parametrize("sizes", [(1,), (1, 3, 2, 7), (1000,)])
def test_a_stream_sends_content_then_the_calls_whole(sizes):
    deltas, reason = _stream(calling(), _split(HERMES_TEXT, sizes))
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me look.\n" and reason == "tool_calls"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    whole, _ = message(calling(), HERMES_TEXT)
    assert [(c["index"], c["function"]) for c in calls] == \
        [(i, c["function"]) for i, c in enumerate(whole["tool_calls"])]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("text", ["just words < and <tool", "<tool_call>{broken",
                                  'x <tool_call>{"name": "nope", "arguments": {}}</tool_call>'])
def test_a_stream_that_makes_no_call_sends_every_character_as_content(text):
    deltas, reason = _stream(calling(), _split(text))
    assert "".join(d["content"] for d in deltas) == text and reason is None


def test_a_named_stream_sends_its_arguments_as_they_come_and_required_at_the_end():
    named = calling({"type": "function", "function": {"name": "get_weather"}})
    deltas, reason = _stream(named, ['{"ci', 'ty":"Oslo"}'])
    assert reason is None
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == \
        '{"city":"Oslo"}'
    assert {d["tool_calls"][0]["index"] for d in deltas} == {0}
    deltas, reason = _stream(calling("required"), _split('[{"name":"get_time","parameters"'
                                                         ':{}}]'))
    assert reason == "tool_calls" and len(deltas) == 1
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_calls_in_history_reach_the_template_as_objects():
    calls = template_tool_calls("messages[1].tool_calls", [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    assert calls[0]["function"]["arguments"] == {"city": "Oslo"}
    with pytest.raises(RequestValidationError) as err:
        template_tool_calls("messages[1].tool_calls", [{"function": {"name": "f",
                                                                     "arguments": "{x"}}])
    assert err.value.field == "messages[1].tool_calls[0].function.arguments"
    for arguments in ("[1, 2]", 5, None):
        with pytest.raises(RequestValidationError, match="must be a JSON object") as err:
            template_tool_calls("messages[1].tool_calls", [{"function": {
                "name": "f", "arguments": arguments}}])
    with pytest.raises(RequestValidationError) as err:
        template_tool_calls("messages[1].tool_calls", [{"id": "c"}])
    assert err.value.field == "messages[1].tool_calls[0].function"
    template = ChatTemplate(CHATML_WITH_TOOLS, {})
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Oslo?"},
                    {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"}]
    text = template.render(conversation, True, calling().template_tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n"
                           "You may call these functions:\n<tools>\n")
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert text.endswith('<|im_start|>tool\n{"temp": 3}<|im_end|>\n<|im_start|>assistant\n')
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template.render(plain, True) == ChatTemplate(CHATML, {}).render(plain, True)


def test_parsed_calls_keep_arguments_as_json_text():
    assert HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}'
                                '</tool_call>')[1] == [ParsedCall("f", '{"a": 1}')]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from pdserve.engine.llm import LLM

    with LLM(str(tiny_dir), num_kv_blocks=128, block_size=4) as engine:
        yield engine


BOUNDED = [  # arguments of bounded length: a random model fills a free string forever
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_calls_always_parse_against_the_function_s_schema(llm, choice):
    """The tiny model's weights are random: every answer that reads as calls whose arguments
    validate is the grammar's doing."""
    from pdserve.worker_api.sampling_params import SamplingParams

    forced = calling(choice, parallel=False, tools=BOUNDED)
    params = [SamplingParams(max_tokens=150, temperature=1.0, seed=seed,
                             structured_outputs=forced.structured_outputs())
              for seed in range(6)]
    outs = llm.generate([[5, 6, 7 + i] for i in range(len(params))], params, use_tqdm=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    for out in outs:
        assert out.finish_reason == "stop", out.text
        answer, _ = message(forced, out.text)
        assert len(answer["tool_calls"]) == 1, out.text
        function = answer["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(function["arguments"]), schemas[function["name"]])
