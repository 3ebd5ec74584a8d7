"""Tool calling on chat (OpenAI ``tools``, ``tool_choice``, ``parallel_tool_calls``): the
request's tools checked, what the chat template sees, how the output is forced or parsed into
``message.tool_calls``, and the streamed ``tool_calls`` deltas.

``tool_choice`` decides how a call is made (docs/tool-calling.md):

* ``none``: the tools are not shown to the model and nothing is parsed;
* ``auto`` (the default with tools): the template renders the tools and the model writes its
  calls in its own syntax, which the server's tool-call parser (``--tool-call-parser``, ``auto``:
  chosen from the chat template's source) turns into ``tool_calls``; text before the first call
  stays the message's ``content``. Output the parser cannot read whole is returned as content;
* ``required`` and a named function: a grammar forces the output, so the arguments always
  parse against the function's JSON schema. A named function's output is its arguments (a JSON
  object); ``required``'s is a JSON array of ``{"name", "parameters"}``, one item at most unless
  ``parallel_tool_calls``. Neither needs a parser, so they work with any template.

A parser reads text, so a family whose call marker is a special token the detokenizer drops
(Llama 3's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``) is also recognised by what follows
the marker: Llama 3 JSON calls are output that starts with ``{"name"``, Mistral's a JSON array
of calls.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.router.errors import RequestValidationError

MAX_TOOLS = 128  # tools in one request, at most (OpenAI's limit)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")  # besides {"type": "function", ...}
ANY_OBJECT: dict = {"type": "object"}  # a function without ``parameters`` takes any object


# -- the request's tools ----------------------------------------------------------------------
@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: dict  # JSON schema of its arguments
    spec: dict  # as the chat template reads it: {"type": "function", "function": {...}}


@dataclass(frozen=True)
class ToolCalling:
    """What a chat request asks of tools, checked (:func:`tool_calling_of`)."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None  # the named function (choice "function")
    parallel: bool  # more than one call per answer
    parser: ToolCallParser | None  # reads ``auto``'s output

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template renders them (None: not shown)."""
        return None if self.choice == "none" else [tool.spec for tool in self.tools]

    @property
    def forced(self) -> bool:
        """The output is forced by a grammar (``required`` or a named function)."""
        return self.choice in ("required", "function")

    def structured_outputs(self) -> dict | None:
        """The constraint that forces the output (``StructuredOutputs`` fields), None for
        ``auto`` and ``none``."""
        if self.choice == "function":
            return {"json": self._tool(self.function).parameters}
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": tool.name},
                                                   "parameters": tool.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for tool in self.tools]
        schema: dict = {"type": "array", "minItems": 1,
                        "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema}

    def _tool(self, name: str | None) -> Tool:
        return next(tool for tool in self.tools if tool.name == name)

    def read(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The whole output as (content, calls); no calls: the text is the content."""
        if self.choice == "function":
            return None, [ParsedCall(self.function or "", text)]
        calls: list[ParsedCall] | None = None
        content: str | None = text
        if self.choice == "required":
            calls = _required_calls(text)
            content = None
        elif self.choice == "auto" and self.parser is not None:
            parsed = self.parser.parse(text)
            if parsed is not None:
                content, calls = parsed
        if not calls or not self._known(calls):
            return text, []
        return content, calls if self.parallel else calls[:1]

    def _known(self, calls: list[ParsedCall]) -> bool:
        names = {tool.name for tool in self.tools}
        return all(call.name in names for call in calls)


def tool_calling_of(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
                    parser: ToolCallParser | None) -> ToolCalling | None:
    """A chat request's tool fields checked (RequestValidationError naming the parameter);
    None when it gives no tools."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise RequestValidationError("tool_choice", "needs tools: give the functions the "
                                         "model may call in `tools`")
        return None
    if not isinstance(tools, list):
        raise RequestValidationError("tools", "must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise RequestValidationError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    checked = tuple(_tool(i, tool) for i, tool in enumerate(tools))
    names = [tool.name for tool in checked]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise RequestValidationError("tools", f"the function name {duplicate!r} is given twice")
    choice, function = _choice(tool_choice, names)
    if choice == "auto" and parser is None:
        raise RequestValidationError(
            "tool_choice", "this server reads no tool-call syntax for this model (its chat "
            "template names none pdserve knows): ask tool_choice 'required' or a named "
            "function, or start the server with --tool-call-parser")
    return ToolCalling(checked, choice, function, True if parallel is None else bool(parallel),
                       parser)


def _tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise RequestValidationError(f"{where}.type", "only tools of type 'function' exist")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RequestValidationError(f"{where}.function", "must be an object with the "
                                     "function's name and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise RequestValidationError(f"{where}.function.name", "must be 1-64 letters, digits, "
                                     f"'_' or '-', got {str(name)[:80]!r}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = ANY_OBJECT
    if not isinstance(parameters, dict):
        raise RequestValidationError(f"{where}.function.parameters",
                                     "must be a JSON schema (an object)")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestValidationError(f"{where}.function.description", "must be a string")
    spec = {"type": "function", "function": {
        "name": name, **({"description": description} if description else {}),
        "parameters": parameters}}
    return Tool(name, parameters, spec)


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise RequestValidationError("tool_choice", f"must be one of "
                                         f"{', '.join(TOOL_CHOICES)} or a named function, got "
                                         f"{tool_choice[:80]!r}")
        return tool_choice, None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise RequestValidationError("tool_choice", "must be a string or "
                                     '{"type": "function", "function": {"name": ...}}')
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if name not in names:
        raise RequestValidationError("tool_choice.function.name", f"{str(name)[:80]!r} is not "
                                     "one of the request's tools")
    return "function", name


# -- messages that hold calls -----------------------------------------------------------------
def template_tool_calls(where: str, calls: list[dict]) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's
    arguments as an object (the API sends them as JSON text)."""
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestValidationError(f"{where}[{j}].function", "must be an object with "
                                         "the called function's name and arguments")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as exc:
                raise RequestValidationError(f"{where}[{j}].function.arguments",
                                             f"is not valid JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise RequestValidationError(f"{where}[{j}].function.arguments",
                                         "must be a JSON object (as text)")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# -- the output -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_object(index: int, call: ParsedCall, id_: str) -> dict:
    """One entry of ``message.tool_calls`` (``index`` only in stream deltas: callers drop it)."""
    return {"index": index, "id": id_, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call(item: Any, *arg_keys: str) -> ParsedCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = next((item[k] for k in arg_keys if k in item), {})
    if not isinstance(arguments, (dict, str)):
        return None
    return ParsedCall(item["name"], _arguments_text(arguments))


def _calls(items: Any, *arg_keys: str) -> list[ParsedCall] | None:
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        return None
    calls = [_call(item, *arg_keys) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _json_calls(text: str, *arg_keys: str) -> list[ParsedCall] | None:
    """The calls ``text`` holds as JSON (one call or a list), None when it holds none whole."""
    try:
        return _calls(json.loads(text), *arg_keys)
    except ValueError:
        return None


def _required_calls(text: str) -> list[ParsedCall] | None:
    return _json_calls(text, "parameters", "arguments")


def _json_values(text: str) -> Iterator[Any]:
    """The JSON values in ``text``, one after another, separated by whitespace or ``;``
    (raises ValueError for anything else)."""
    decoder, i = json.JSONDecoder(), 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return
        value, i = decoder.raw_decode(text, i)
        yield value


class ToolCallParser(Protocol):
    """Reads one model family's tool-call syntax."""

    name: str

    def start(self, text: str) -> int | None:
        """Where the first call begins in ``text`` (None: no call yet)."""
        ...

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` could be the beginning of a call (kept
        back from a stream until the next text says)."""
        ...

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        """(content before the calls or None, calls), or None when ``text`` holds no call
        that reads whole."""
        ...


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _content(text: str) -> str | None:
    return text.strip() or None


class HermesParser:
    """Qwen 2.5 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
    block per call, after any text."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def start(self, text: str) -> int | None:
        at = text.find(self.OPEN)
        return None if at < 0 else at

    def held(self, text: str) -> int:
        return _held_prefix(text, self.OPEN)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        at = self.start(text)
        if at is None:
            return None
        calls = []
        for block in self.BLOCK.findall(text[at:]):
            parsed = _json_calls(block, "arguments", "parameters")
            if parsed is None:
                return None
            calls.extend(parsed)
        return _content(text[:at]), calls


class Llama3JsonParser:
    """Llama 3.1+ JSON calls: the answer is ``{"name": ..., "parameters": {...}}`` (after
    ``<|python_tag|>`` when special tokens are kept), several separated by ``;``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _body(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.TAG):
            return len(text) - len(stripped) + len(self.TAG)
        if stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def start(self, text: str) -> int | None:
        at = text.find(self.TAG)
        return at if at >= 0 else (0 if self._body(text) is not None else None)

    def held(self, text: str) -> int:
        return len(text) if not text.strip() else _held_prefix(text, self.TAG)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        at = text.find(self.TAG)
        content = None
        if at > 0:
            content, text = _content(text[:at]), text[at:]
        body = self._body(text)
        if body is None:
            return None
        try:
            calls = _calls(list(_json_values(text[body:])), "parameters", "arguments")
        except ValueError:
            return None
        return None if calls is None else (content, calls)


class MistralParser:
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (v3), or
    ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11+); without the marker (a dropped special
    token) an answer that is a JSON array of calls."""

    name = "mistral"
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def start(self, text: str) -> int | None:
        at = text.find(self.MARKER)
        if at >= 0:
            return at
        return 0 if text.lstrip().startswith("[{") else None

    def held(self, text: str) -> int:
        stripped = text.strip()
        if stripped in ("", "["):
            return len(text)
        return _held_prefix(text, self.MARKER)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        at = self.start(text)
        if at is None:
            return None
        content = _content(text[:at])
        parts = [p for p in text[at:].split(self.MARKER) if p.strip()]
        calls: list[ParsedCall] = []
        for part in parts:
            if self.ARGS in part:
                name, _, arguments = part.partition(self.ARGS)
                try:
                    value = json.loads(arguments)
                except ValueError:
                    return None
                if not isinstance(value, dict) or not name.strip():
                    return None
                calls.append(ParsedCall(name.strip(), _arguments_text(value)))
                continue
            parsed = _json_calls(part, "arguments", "parameters")
            if parsed is None:
                return None
            calls.extend(parsed)
        return (content, calls) if calls else None


PARSERS: dict[str, type] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
TOOL_CALL_PARSERS = ("auto", "none", *PARSERS)  # --tool-call-parser's choices
# what in a chat template's source says which syntax it teaches the model, first match wins
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                   ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))


def parser_for(setting: str, template_source: str | None) -> ToolCallParser | None:
    """The parser ``--tool-call-parser`` names; ``auto``: the one the template's source shows
    (None: it shows none pdserve knows, or ``none``)."""
    if setting not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {setting!r}")
    if setting == "auto":
        source = template_source or ""
        setting = next((name for sign, name in _TEMPLATE_SIGNS if sign in source), "none")
    return None if setting == "none" else PARSERS[setting]()


# -- the answer, whole or streamed ------------------------------------------------------------
class ToolCallStream:
    """Turns the generated text into chat message deltas for one request with tools.

    ``feed`` each text delta, then ``end``; each returns the deltas to send. A named function
    streams its arguments as they come; ``auto`` streams content until a call may begin, holds
    the rest and sends the calls whole at the end (or the held text as content when it does
    not read as calls); ``required`` sends its calls at the end."""

    def __init__(self, calling: ToolCalling) -> None:
        self._calling = calling
        self._text = ""  # all text so far
        self._sent = 0  # characters of it sent as content (auto)
        self._holding = False  # a call began: nothing more goes out as content
        self.called = False  # tool_calls were sent (finish_reason "tool_calls" unless named)

    def feed(self, text: str) -> list[dict]:
        self._text += text
        calling = self._calling
        if calling.choice == "function":
            deltas = []
            if not self.called:
                self.called = True
                deltas.append({"tool_calls": [tool_call_object(
                    0, ParsedCall(calling.function or "", ""), call_id())]})
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        if calling.choice == "required" or self._holding:
            return []
        parser = calling.parser
        assert parser is not None
        at = parser.start(self._text)
        if at is not None:
            self._holding = True
            return self._content_up_to(at)
        return self._content_up_to(len(self._text) - parser.held(self._text))

    def end(self) -> list[dict]:
        if self._calling.choice == "function":
            return self.feed("") if not self.called else []
        content, calls = self._calling.read(self._text)
        if not calls:
            return self._content_up_to(len(self._text))
        self.called = True
        return [{"tool_calls": [tool_call_object(i, call, call_id())]}
                for i, call in enumerate(calls)]

    def _content_up_to(self, end: int) -> list[dict]:
        if end <= self._sent:
            return []
        piece, self._sent = self._text[self._sent:end], end
        return [{"content": piece}]

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish reason calls give (None: the generation's own)."""
        return "tool_calls" if self.called and self._calling.choice != "function" else None


def message(calling: ToolCalling, text: str) -> tuple[dict, str | None]:
    """The whole answer's ``message`` and the finish reason its calls give (None: the
    generation's own)."""
    content, calls = calling.read(text)
    if not calls:
        return {"role": "assistant", "content": text}, None
    tool_calls = []
    for i, call in enumerate(calls):
        entry = tool_call_object(i, call, call_id())
        del entry["index"]
        tool_calls.append(entry)
    reason = None if calling.choice == "function" else "tool_calls"
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}, reason
