"""The OpenAI wire format the HTTP front door speaks: request bodies, response objects, errors.

Requests are pydantic models (unknown fields are ignored, as OpenAI's SDKs send some pdserve
does not use); :func:`sampling_params` turns one into ``SamplingParams`` with the same checks
as the gRPC path and errors named by the OpenAI parameter (``param``), and
:func:`max_tokens_of` says which parameter set max_tokens, if one did. Fields OpenAI defines
but pdserve cannot honour (``best_of`` above ``n`` with ``stream``, ``suffix``, non-text
content parts) are a 400 naming the parameter, never silently dropped. ``n`` > 1 returns
``choices`` 0..n-1 forked from one prefill (streamed chunks carry their index, each choice ends
with its own ``finish_reason``); ``best_of`` (completions) returns the ``n`` of highest
cumulative log-probability. Completions' ``echo`` returns the prompt before the completion,
and with ``logprobs: k`` the prompt tokens' logprobs too (the first token's null), as vLLM;
``max_tokens: 0`` with ``echo`` generates nothing (lm-eval's loglikelihood requests): the
engine runs the prefill, which samples one token, and the door drops it. ``logit_bias`` maps
token ids (JSON string keys) to biases in [-100, 100] added to the logits before sampling (at
most 1024 entries); reported logprobs are the model's, before the bias, as vLLM's.
``response_format`` (``text``, ``json_object``, ``json_schema``, ``structural_tag``) constrains
the output, as vLLM's ``structured_outputs`` extra does (``json``, ``json_object``, ``regex``,
``choice``, ``grammar``, ``structural_tag``; one or the other). Chat's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` are read by ``pdserve.router.tool_calling``.

pdserve's extras, accepted in the body (``extra_body`` in the ``openai`` package): ``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``priority``,
``structured_outputs`` and ``timeout`` (seconds the request may take; past it the answer is
504).

Responses are plain dicts built here, so the server and the tests read one definition.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.router.errors import (
    DeadlineExceededError,
    NoWorkersError,
    PermissionDeniedError,
    QueueFullError,
    RequestFailedError,
    RequestTooLargeError,
    RequestValidationError,
    UnknownModelError,
)
from pdserve.router.tool_calling import ToolCalling, template_tool_calls
from pdserve.router.validation import check_logit_bias
from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.sampling_params import (
    CONSTRAINT_KINDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
)

UNLIKELY_LOGPROB = -9999.0  # OpenAI's stand-in for a logprob too small to report
MAX_TIMEOUT_S = 86_400.0  # the longest ``timeout`` a request may ask for (a day)
DEFAULT_RETRY_AFTER_S = 1.0  # a 429's Retry-After when the queue gives no better hint
BODY_BYTES_PER_CONTEXT_TOKEN = 64  # the default body bound: this much per token of context,
BODY_BYTES_BASE = 64 * 1024  # plus this (a prompt's JSON is far below it; see max_body_bytes)
INLINE_PARSE_BYTES = 64 * 1024  # bodies up to this are parsed on the event loop, larger in a
# thread, so a large body never holds the loop (and every stream on it) for its whole parse
_TOKEN_KEY = re.compile(r"-?[0-9]{1,20}")  # a logit_bias key: a token id in decimal
FINISH_REASONS = {"stop": "stop", "length": "length",  # pdserve's -> OpenAI's
                  "tool_calls": "tool_calls"}  # (the last one the HTTP front door's own)


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status  # HTTP status
        self.message = message
        self.type = type_
        self.param = param  # the request parameter at fault, when one is
        self.code = code
        self.retry_after_s = retry_after_s  # a 429's hint: the Retry-After header

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Headers the error is answered with: Retry-After (whole seconds, at least 1)."""
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}


# Router error -> (status, type, code); the first match wins. A validation or permission error
# names its request parameter (``param``).
_HTTP_BY_ERROR: tuple[tuple[type[Exception], int, str, str | None], ...] = (
    (RequestValidationError, 400, "invalid_request_error", None),
    (PermissionDeniedError, 403, "permission_error", None),
    (QueueFullError, 429, "rate_limit_error", "queue_full"),
    (RequestTooLargeError, 400, "invalid_request_error", "request_too_large"),
    (NoWorkersError, 503, "service_unavailable", "no_workers"),
    (DeadlineExceededError, 504, "timeout", "deadline_exceeded"),
    (RequestFailedError, 500, "server_error", "request_failed"),
    (UnknownModelError, 404, "invalid_request_error", "model_not_found"),
)


def openai_error(exc: Exception) -> OpenAIError:
    """The OpenAI error an exception from validation, preparation or the backend is answered
    with (a refused field's error code is ``<field>_not_allowed``: ``priority_not_allowed``)."""
    if isinstance(exc, OpenAIError):
        return exc
    for error_type, status, type_, code in _HTTP_BY_ERROR:
        if isinstance(exc, error_type):
            param = getattr(exc, "field", None)
            if isinstance(exc, PermissionDeniedError):
                code = f"{exc.field}_not_allowed"
            retry_after = getattr(exc, "retry_after_s", None) if status == 429 else None
            if status == 429 and retry_after is None:
                retry_after = DEFAULT_RETRY_AFTER_S
            return OpenAIError(status, str(exc), type_, param, code, retry_after)
    return OpenAIError(500, f"internal error ({type(exc).__name__})", "server_error")


def max_body_bytes(max_context_tokens: int) -> int:
    """The default bound on a request body: room for any prompt that can fit the context (a
    token is a few characters, a character at most a 6-byte JSON escape) and the other fields,
    far below what it costs to parse a body that could never be served."""
    return BODY_BYTES_BASE + BODY_BYTES_PER_CONTEXT_TOKEN * max_context_tokens


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """A request body as ``model``; malformed JSON or a refused field is a 400 naming it."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise body_error(exc.errors()) from None


def body_error(errors: list) -> OpenAIError:
    """The 400 for pydantic's first complaint, the parameter named by its path
    (``messages[0].role``)."""
    first = (errors or [{}])[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in loc).lstrip(".")
    message = first.get("msg", "invalid request body")
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param or None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False  # one more chunk before [DONE]: empty choices and the usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries
    # the usage so far (guidellm asks for it, aiperf with --per-chunk-usage)


class LoadLoraAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body; an admin call)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)  # what requests put in ``model``
    lora_path: str = Field(min_length=1, max_length=4096)  # the PEFT folder, as the workers
    # see it


class UnloadLoraAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; an admin call)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)


class _SamplingBody(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str  # the served model's name (GET /v1/models)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None  # completions (1..16), forked from one prefill; choices 0..n-1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None  # token id (a string) -> bias in [-100, 100]
    user: str | None = None  # accepted, unused
    # pdserve extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S,
                                  allow_inf_nan=False)  # seconds; past it: 504

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk's ``usage`` is the usage so far (never null)."""
        return bool(self.include_usage and self.stream_options is not None
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top log-probabilities per token (0..20)
    echo: bool | None = None  # the prompt before the completion (its logprobs with logprobs)
    suffix: str | None = None  # refused
    best_of: int | None = None  # sequences generated (n..16), the n most likely returned;
    # not with stream


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to which call


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # preferred over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # functions the model may call
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required or a function
    parallel_tool_calls: bool | None = None  # more than one call per answer (default true)
    add_generation_prompt: bool = True  # the template's assistant header (pdserve extra)


def _refuse(param: str, message: str):
    raise OpenAIError(400, message, param=param, code="unsupported")


def check_supported(body: _SamplingBody) -> None:
    """400 naming the parameter for what the request asks and pdserve cannot do."""
    if isinstance(body, CompletionRequest):
        if body.suffix:
            _refuse("suffix", "suffix is not supported")
        if body.stream and body.best_of not in (None, body.n or 1):
            _refuse("best_of", f"best_of ({body.best_of}) above n cannot stream (the n best "
                               f"are known only once every sequence ends)")


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as chat templates read them: role, text content, an assistant's tool calls
    (arguments as objects) and a tool message's call id."""
    out = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    _refuse(f"messages[{i}].content", f"content parts of type {part.type!r} "
                                                      "are not supported (text only)")
                texts.append(part.text)
            content = "".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = template_tool_calls(f"messages[{i}].tool_calls",
                                                      message.tool_calls)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def structured_outputs_of(body: _SamplingBody,
                          tools: ToolCalling | None = None) -> tuple[str, dict | None]:
    """The parameter that constrains the output and the constraint as ``StructuredOutputs``
    fields (None: free text); a 400 naming the parameter for a format pdserve does not know.
    ``tools``: the chat's tool calling, whose ``required`` or named function forces the
    output itself."""
    param, given = _response_constraint(body)
    forced = tools.structured_outputs() if tools is not None else None
    if forced is None:
        return param, given
    if given is not None:
        raise RequestValidationError("tool_choice", f"a tool_choice that forces a call "
                                     f"decides the output's shape; drop {param}")
    return "tool_choice", forced


def _response_constraint(body: _SamplingBody) -> tuple[str, dict | None]:
    fmt = body.response_format
    kind = None if fmt is None else fmt.get("type")
    if fmt is not None and kind not in RESPONSE_FORMATS:
        raise RequestValidationError("response_format.type",
                                     f"must be one of {', '.join(RESPONSE_FORMATS)}, "
                                     f"got {kind!r}")
    if body.structured_outputs is not None:
        if kind not in (None, "text"):
            raise RequestValidationError("structured_outputs", "give either response_format "
                                         "or structured_outputs, not both")
        return "structured_outputs", body.structured_outputs
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestValidationError("response_format.json_schema.schema",
                                         "a json_schema response format needs its schema "
                                         "(an object)")
        return "response_format", {"json": schema}
    if kind == "structural_tag":  # xgrammar's ("format") or vLLM's older form ("structures")
        return "response_format", {"structural_tag": fmt}
    return "response_format", None


def echoes_prompt_only(body: _SamplingBody) -> bool:
    """A completion that asks for its prompt echoed and nothing generated (``max_tokens`` 0):
    the engine runs with max_tokens 1 (a prefill samples a token) and the door drops it."""
    return isinstance(body, CompletionRequest) and bool(body.echo) and body.max_tokens == 0


def constraint_field(body: _SamplingBody, kind: str,
                     tools: ToolCalling | None = None) -> str:
    """The parameter errors about the body's constraint (of ``kind``) name: ``tools`` when
    the tool calling forces the output (the functions' schemas make the constraint)."""
    if tools is not None and tools.forced:
        return "tools"
    if body.structured_outputs is not None:
        return f"structured_outputs.{kind}"
    return "response_format.json_schema.schema" if kind == "json" else "response_format"


def max_tokens_of(body: _SamplingBody) -> tuple[str, int | None]:
    """The parameter that sets max_tokens (chat's ``max_completion_tokens`` before
    ``max_tokens``) and its value, None when the body gives neither (1 for
    :func:`echoes_prompt_only`)."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens", body.max_completion_tokens
    if echoes_prompt_only(body):
        return "max_tokens", 1
    return "max_tokens", body.max_tokens


def sampling_params(body: _SamplingBody, vocab_size: int,
                    default_max_tokens: int | None = None,
                    tools: ToolCalling | None = None) -> SamplingParams:
    """The body's sampling fields as ``SamplingParams``; an absent max_tokens becomes
    ``default_max_tokens`` (None: ``SamplingParams``' own); ``tools`` may force the output
    (:func:`structured_outputs_of`). RequestValidationError names the parameter."""
    chat = isinstance(body, ChatCompletionRequest)
    max_param, max_tokens = max_tokens_of(body)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestValidationError("top_logprobs", "needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = logprobs if body.echo else None
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    values = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
              "top_k": body.top_k, "min_p": body.min_p,
              "repetition_penalty": body.repetition_penalty,
              "presence_penalty": body.presence_penalty,
              "frequency_penalty": body.frequency_penalty, "seed": body.seed,
              "ignore_eos": body.ignore_eos, "logprobs": logprobs, "priority": body.priority,
              "prompt_logprobs": prompt_logprobs, "n": body.n,
              "best_of": None if chat else body.best_of}
    outputs_param, values["structured_outputs"] = structured_outputs_of(body, tools)
    values["logit_bias"] = logit_bias_of(body)
    kwargs = {k: v for k, v in values.items() if v is not None}
    try:
        params = SamplingParams(stop=stop, stop_token_ids=list(body.stop_token_ids or []),
                                **kwargs)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        param = {"max_tokens": max_param, "logprobs": "top_logprobs" if chat else "logprobs",
                 "prompt_logprobs": "logprobs"}.get(name, name)
        if name.split(".")[0] == "structured_outputs":
            kind = name.partition(".")[2]
            param = constraint_field(body, kind, tools) if kind in CONSTRAINT_KINDS \
                else outputs_param
        raise RequestValidationError(param, str(exc)) from exc
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise RequestValidationError("top_logprobs" if chat else "logprobs",
                                     f"at most {MAX_LOGPROBS}")
    check_logit_bias("logit_bias", params.logit_bias, vocab_size)
    return params


def logit_bias_of(body: _SamplingBody) -> dict[int, Any] | None:
    """The body's ``logit_bias`` with its JSON string keys as token ids (the values are
    SamplingParams' to check); a key that is not a decimal integer is a 400 naming it."""
    if body.logit_bias is None:
        return None
    if len(body.logit_bias) > MAX_LOGIT_BIAS:  # (before converting a huge map's keys)
        raise RequestValidationError("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} "
                                     f"entries, got {len(body.logit_bias)}")
    out = {}
    for key, bias in body.logit_bias.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise RequestValidationError("logit_bias", f"keys must be token ids, got {key[:40]!r}")
        out[int(key)] = bias
    return out


# -- responses ------------------------------------------------------------------------------
def finish_reason(reason: str | None) -> str | None:
    """pdserve's finish reason as OpenAI's (``abort`` never reaches here: it is an error)."""
    return None if reason is None else FINISH_REASONS[reason]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finite(logprob: float | None) -> float:
    return logprob if logprob is not None and math.isfinite(logprob) else UNLIKELY_LOGPROB


def _top(top: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda item: -item[1])[:num_top]


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float] | None],
                        num_top: int, token_text, offset: int) -> dict:
    """The completions ``logprobs`` object for ``token_ids``; ``offset``: characters of text
    already returned before them. A None entry (an echoed prompt's first token) is null."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict | None] = []
    offsets: list[int] = []
    for token_id, top in zip(token_ids, logprobs, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        if top is None:  # an echoed prompt's first token: nothing precedes it
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(_finite(top.get(token_id)))
            tops.append({token_text(t): _finite(lp) for t, lp in _top(top, num_top)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], num_top: int,
                  token_text) -> dict:
    """The chat ``logprobs`` object (``content``: one entry per token)."""
    content = []
    for token_id, top in zip(token_ids, logprobs, strict=True):
        text = token_text(token_id)
        content.append({
            "token": text, "logprob": _finite(top.get(token_id)),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": token_text(t), "logprob": _finite(lp),
                              "bytes": list(token_text(t).encode("utf-8"))}
                             for t, lp in _top(top, num_top)]})
    return {"content": content}


def completion_choice(index: int, text: str, reason: str | None,
                      logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason(reason)}


def chat_choice(index: int, message: dict, reason: str | None, logprobs: dict | None) -> dict:
    """``message``: ``{"role": "assistant", "content": ...}`` plus ``tool_calls`` when the
    answer made any (``tool_calling.message``)."""
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason(reason)}


def completion_object(request_id: str, model: str, created: int, choices: list[dict],
                      usage_: dict) -> dict:
    """``choices``: :func:`completion_choice` of each index, in order."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_object(request_id: str, model: str, created: int, choices: list[dict],
                usage_: dict) -> dict:
    """``choices``: :func:`chat_choice` of each index, in order."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     reason: str | None, logprobs: dict | None, with_usage: bool,
                     index: int = 0) -> dict:
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
             "choices": [completion_choice(index, text, reason, logprobs)]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(request_id: str, model: str, created: int, delta: dict, reason: str | None,
               logprobs: dict | None, with_usage: bool, index: int = 0) -> dict:
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish_reason(reason)}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, model: str, created: int, chat: bool, usage_: dict) -> dict:
    """The one extra chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_}


def model_list(model_name: str, max_context_tokens: int, created: int,
               adapters: Iterable[AdapterRef] = ()) -> dict:
    """``GET /v1/models``: the served model by name (never where its files lie), then each
    LoRA adapter as vLLM lists one: ``parent`` the model's name, ``root`` its folder."""
    base = {"id": model_name, "object": "model", "created": created, "owned_by": "pdserve",
            "root": model_name, "parent": None, "max_model_len": max_context_tokens}
    return {"object": "list", "data": [base] + [
        {"id": a.name, "object": "model", "created": created, "owned_by": "pdserve",
         "root": a.path, "parent": model_name, "max_model_len": max_context_tokens}
        for a in adapters]}


def now() -> int:
    return int(time.time())


def merge_logprobs(parts: list[dict], chat: bool) -> dict:
    """Concatenate per-delta logprobs objects into one."""
    if chat:
        return {"content": [entry for part in parts for entry in part["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [v for part in parts for v in part[key]] for key in keys}
