"""The field rules of a request, and the gRPC door's translation of a ``GenerateRequest``.

Each rule raises ``RequestValidationError(field, message)`` naming the field as the client's
wire format spells it (``sampling.top_p`` and ``token_ids`` on gRPC, ``top_p`` and ``prompt``
on HTTP), which the doors return as INVALID_ARGUMENT or an HTTP 400 with ``param``.

* The rules both doors' requests meet, applied once by the preparation stage
  (``pdserve.router.prepare``): :func:`check_prompt_text` (a text's size before any tokenizer
  sees it: at most ``MAX_PROMPT_CHARS_PER_TOKEN`` characters per context token),
  :func:`check_token_ids` (inside the vocabulary, one vectorized check, no Python loop per
  id), :func:`check_max_tokens` (below the context), :func:`check_logit_bias` (its keys
  inside the vocabulary; each door calls it once it has the map as ids).
* :class:`ClientRequest`: a request as a door translated it from its wire format, what the
  preparation stage takes. Nothing in it is decided yet: no tokenizing, no limits.
* The gRPC door's translation: :func:`client_request_from_proto` checks the request id, that
  an input is set, and every sampling field (reusing ``SamplingParams``' own checks, NaN and
  infinity included: :func:`sampling_params_from_proto`).

Defaults for unset sampling fields are ``SamplingParams``' own: max_tokens 16, temperature 1.0
(as OpenAI), top_p 1.0, top_k 0 (off), min_p 0, penalties neutral, seed chosen by the engine.
An unset max_tokens is a ceiling the preparation stage lowers to the room left in the context;
an explicit one that does not fit is an error.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.api import generation_pb2
from pdserve.router.adapters import ServedAdapters, resolve_model
from pdserve.router.backend import ModelSpec
from pdserve.router.errors import RequestValidationError
from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.sampling_params import SamplingParams

__all__ = ["RequestValidationError", "ClientRequest", "client_request_from_proto",
           "check_request_id", "check_prompt_text", "check_token_ids",
           "check_max_tokens", "check_logit_bias", "sampling_params_from_proto"]

MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]+")
MAX_PROMPT_CHARS_PER_TOKEN = 32  # a longer text can never fit the context (tokens average < 8)

# Optional scalar fields of pdserve.v1.SamplingParams, named as in SamplingParams.
_SCALAR_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "ignore_eos", "logprobs",
                  "priority", "prompt_logprobs", "n", "best_of")
_ALL_FIELDS = frozenset(_SCALAR_FIELDS + ("stop", "stop_token_ids", "structured_outputs",
                                           "logit_bias"))


@dataclass(frozen=True)
class ClientRequest:
    """A request as a front door translated it from its wire format, before the preparation
    stage (``pdserve.router.prepare``) decides anything about it."""

    label: str  # the client's id, or one the door made: echoed, never a key
    prompt: str | list[int]  # text to tokenize, or token ids (a chat the door rendered)
    params: SamplingParams  # the client's sampling fields; an absent max_tokens is the door's
    # default, a ceiling the preparation stage lowers to the room left in the context
    max_tokens: int | None  # as the client gave it (then params.max_tokens); None: none given
    deadline: float | None = None  # time.monotonic() instant; None: no deadline
    claimed_tenant: str = ""  # the tenant the client names; heeded only on a router without keys
    prompt_field: str = "prompt"  # the wire field errors about the prompt name
    max_tokens_field: str = "max_tokens"  # the wire field errors about max_tokens name
    constraint_field: str | None = None  # the wire field errors about the structured output
    # name (None: structured_outputs.<kind>)
    adapter: AdapterRef | None = None  # the LoRA adapter the request's model names (the door
    # resolved it: ``router.adapters.resolve_model``); None: the base model

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens != self.params.max_tokens:
            raise ValueError(f"max_tokens must be None or params.max_tokens "
                             f"({self.params.max_tokens}), got {self.max_tokens!r}")


def check_request_id(request_id: str) -> None:
    """Raise unless ``request_id`` is empty or a short id of safe characters."""
    if not request_id:
        return
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestValidationError(
            "request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters, "
            f"got {len(request_id)}")
    if not _REQUEST_ID_PATTERN.fullmatch(request_id):
        raise RequestValidationError(
            "request_id", f"may hold only letters, digits and . _ : -, got {request_id!r}")


def check_prompt_text(field: str, text: str, model: ModelSpec) -> None:
    """Raise unless ``text`` is short enough that it could fit the context once tokenized."""
    limit = MAX_PROMPT_CHARS_PER_TOKEN * model.max_context_tokens
    if len(text) > limit:
        raise RequestValidationError(
            field, f"prompt of {len(text)} characters can never fit the model's context of "
            f"{model.max_context_tokens} tokens (at most {limit} characters)")


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise unless every id is an integer in [0, vocab_size); one vectorized pass."""
    if len(token_ids) == 0:
        return
    try:
        ids = np.asarray(token_ids, dtype=np.int64)
    except (OverflowError, ValueError, TypeError):
        raise RequestValidationError(field, "token ids must be integers in [0, "
                                            f"{vocab_size})") from None
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        index = int(bad[0])
        raise RequestValidationError(
            field, f"token id {int(ids[index])} at index {index} is outside the vocabulary "
            f"[0, {vocab_size})")



def check_logit_bias(field: str, logit_bias: dict[int, float] | None, vocab_size: int) -> None:
    """Raise naming ``field`` and the key unless every biased id is in [0, vocab_size)."""
    outside = [t for t in logit_bias or () if t >= vocab_size]
    if outside:
        raise RequestValidationError(field, f"token id {outside[0]} is outside the vocabulary "
                                            f"[0, {vocab_size})")


def check_max_tokens(field: str, max_tokens: int, model: ModelSpec) -> None:
    """Raise when ``max_tokens`` alone leaves no room for a prompt in the context."""
    if max_tokens >= model.max_context_tokens:
        raise RequestValidationError(
            field, f"must be below the model's context of {model.max_context_tokens} tokens, "
            f"got {max_tokens}")


def structured_outputs_from_proto(outputs: generation_pb2.StructuredOutputs) -> dict:
    """The proto's one kind as ``StructuredOutputs`` fields (checked by SamplingParams)."""
    kind = outputs.WhichOneof("kind")
    if kind is None:
        return {}  # (SamplingParams names the missing kind)
    if kind == "choice":
        return {"choice": list(outputs.choice.choices)}
    return {kind: getattr(outputs, kind)}


def sampling_params_from_proto(sampling: generation_pb2.SamplingParams,
                               vocab_size: int) -> SamplingParams:
    """Build ``SamplingParams`` from the proto; unset fields take its defaults."""
    kwargs: dict[str, object] = {
        name: getattr(sampling, name) for name in _SCALAR_FIELDS if sampling.HasField(name)}
    stop = list(sampling.stop)
    stop_token_ids = list(sampling.stop_token_ids)
    if sampling.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(sampling.structured_outputs)
    if len(sampling.logit_bias):
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    try:
        params = SamplingParams(stop=stop, stop_token_ids=stop_token_ids, **kwargs)
    except ValueError as exc:
        # SamplingParams' messages start with the field's name (a part's: its dotted path).
        name = str(exc).split(" ", 1)[0]
        field = f"sampling.{name}" if name.split(".")[0] in _ALL_FIELDS else "sampling"
        raise RequestValidationError(field, str(exc)) from exc
    check_token_ids("sampling.stop_token_ids", params.stop_token_ids, vocab_size)
    check_logit_bias("sampling.logit_bias", params.logit_bias, vocab_size)
    if params.num_sequences > params.n:
        raise RequestValidationError("sampling.best_of", f"best_of ({params.best_of}) above n "
                                     f"({params.n}) is not served on a stream (the n best are "
                                     f"known only once every sequence ends): use the HTTP "
                                     f"completions endpoint without stream")
    return params


def client_request_from_proto(request: generation_pb2.GenerateRequest, model: ModelSpec,
                              deadline: float | None = None,
                              metadata_tenant: str = "",
                              adapters: ServedAdapters | None = None) -> ClientRequest:
    """The gRPC door's translation: what the proto alone can tell is wrong, and the rest as a
    :class:`ClientRequest` (labelled with the request id, or a new one when it is empty; the
    tenant claimed by the ``tenant`` field, else by ``metadata_tenant``; ``model`` empty or
    the model's name for the base model, else one of ``adapters``)."""
    check_request_id(request.request_id)
    adapter = None
    if request.model:
        adapter = resolve_model("model", request.model, (model.model_name,), adapters)
    kind = request.WhichOneof("input")
    if kind is None:
        raise RequestValidationError("input", "set either text or token_ids")
    prompt = request.text if kind == "text" else list(request.token_ids.ids)
    params = sampling_params_from_proto(request.sampling, model.vocab_size)
    max_tokens = params.max_tokens if request.sampling.HasField("max_tokens") else None
    return ClientRequest(
        label=request.request_id or uuid.uuid4().hex, prompt=prompt, params=params,
        max_tokens=max_tokens, deadline=deadline,
        claimed_tenant=request.tenant or metadata_tenant, prompt_field=kind,
        max_tokens_field="sampling.max_tokens",
        constraint_field=None if params.structured_outputs is None
        else f"sampling.structured_outputs.{params.structured_outputs.kind}",
        adapter=adapter)
