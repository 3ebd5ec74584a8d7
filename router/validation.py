"""Check a GenerateRequest before any worker sees it.

Two steps, because a text prompt must be tokenized (by the backend) in between:

1. ``validate_generate_request(request, model)``: request id, input present and non-empty,
   the prompt text's size (before any tokenizer sees it: at most
   ``MAX_PROMPT_CHARS_PER_TOKEN`` characters per context token), token ids inside the
   vocabulary (one vectorized check, no Python loop per id), every sampling field (reusing
   ``SamplingParams``' own checks, NaN and infinity included), max_tokens below the context.
2. ``fit_to_context(prompt_token_ids, validated, model)``: prompt + max_tokens within the
   model's context.

Each failure raises ``RequestValidationError(field, message)`` with the proto field path
(``sampling.top_p``, ``token_ids``), which the server returns as INVALID_ARGUMENT.

Defaults for unset sampling fields are ``SamplingParams``' own: max_tokens 16, temperature 1.0
(as OpenAI), top_p 1.0, top_k 0 (off), min_p 0, penalties neutral, seed chosen by the engine.
An unset max_tokens is shrunk to the room left in the context when the prompt is long; an
explicit one that does not fit is an error.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.api import generation_pb2
from pdserve.router.backend import ModelSpec
from pdserve.router.errors import RequestValidationError
from pdserve.worker_api.sampling_params import SamplingParams

__all__ = ["RequestValidationError", "ValidatedRequest", "validate_generate_request",
           "check_request_id", "check_prompt_text", "check_token_ids",
           "check_max_tokens", "sampling_params_from_proto", "fit_to_context"]

MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]+")
MAX_PROMPT_CHARS_PER_TOKEN = 32  # a longer text can never fit the context (tokens average < 8)

# Optional scalar fields of pdserve.v1.SamplingParams, named as in SamplingParams.
_SCALAR_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "ignore_eos", "logprobs",
                  "priority")
_ALL_FIELDS = frozenset(_SCALAR_FIELDS + ("stop", "stop_token_ids"))


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed step 1; exactly one of the prompt fields is set."""

    request_id: str  # as given; "" = the server assigns one
    prompt_text: str | None  # the prompt when given as text (to be tokenized)
    prompt_token_ids: list[int] | None  # the prompt when given as ids (range-checked)
    params: SamplingParams  # sampling parameters with defaults filled in
    max_tokens_given: bool  # False: fit_to_context may shrink max_tokens to fit

    @property
    def input_field(self) -> str:
        """The proto field the prompt came in, for error messages."""
        return "text" if self.prompt_text is not None else "token_ids"


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



def check_max_tokens(field: str, max_tokens: int, model: ModelSpec) -> None:
    """Raise when ``max_tokens`` alone leaves no room for a prompt in the context."""
    if max_tokens >= model.max_context_tokens:
        raise RequestValidationError(
            field, f"must be below the model's context of {model.max_context_tokens} tokens, "
            f"got {max_tokens}")


def sampling_params_from_proto(sampling: generation_pb2.SamplingParams,
                               vocab_size: int) -> SamplingParams:
    """Build ``SamplingParams`` from the proto; unset fields take its defaults."""
    kwargs: dict[str, object] = {
        name: getattr(sampling, name) for name in _SCALAR_FIELDS if sampling.HasField(name)}
    stop = list(sampling.stop)
    stop_token_ids = list(sampling.stop_token_ids)
    try:
        params = SamplingParams(stop=stop, stop_token_ids=stop_token_ids, **kwargs)
    except ValueError as exc:
        # SamplingParams' messages start with the field's name.
        name = str(exc).split(" ", 1)[0]
        field = f"sampling.{name}" if name in _ALL_FIELDS else "sampling"
        raise RequestValidationError(field, str(exc)) from exc
    check_token_ids("sampling.stop_token_ids", params.stop_token_ids, vocab_size)
    return params


def validate_generate_request(request: generation_pb2.GenerateRequest,
                              model: ModelSpec) -> ValidatedRequest:
    """Step 1: everything that can be checked before tokenization."""
    check_request_id(request.request_id)
    kind = request.WhichOneof("input")
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    if kind is None:
        raise RequestValidationError("input", "set either text or token_ids")
    if kind == "text":
        if not request.text:
            raise RequestValidationError("text", "must be non-empty")
        check_prompt_text("text", request.text, model)
        prompt_text = request.text
    else:
        prompt_token_ids = list(request.token_ids.ids)
        if not prompt_token_ids:
            raise RequestValidationError("token_ids", "must hold at least one token id")
        check_token_ids("token_ids", prompt_token_ids, model.vocab_size)
    params = sampling_params_from_proto(request.sampling, model.vocab_size)
    if request.sampling.HasField("max_tokens"):
        check_max_tokens("sampling.max_tokens", params.max_tokens, model)
    return ValidatedRequest(
        request_id=request.request_id, prompt_text=prompt_text,
        prompt_token_ids=prompt_token_ids, params=params,
        max_tokens_given=request.sampling.HasField("max_tokens"))


def fit_to_context(prompt_token_ids: list[int], validated: ValidatedRequest,
                   model: ModelSpec) -> SamplingParams:
    """Step 2: the params to run with, after checking prompt + max_tokens fit the context."""
    num_prompt = len(prompt_token_ids)
    limit = model.max_context_tokens
    if num_prompt == 0:
        raise RequestValidationError(validated.input_field, "tokenizes to no tokens")
    if num_prompt >= limit:
        raise RequestValidationError(
            validated.input_field, f"prompt has {num_prompt} tokens but the model's context "
            f"is {limit}, leaving no room to generate")
    room = limit - num_prompt
    params = validated.params
    if params.max_tokens <= room:
        return params
    if validated.max_tokens_given:
        raise RequestValidationError(
            "sampling.max_tokens", f"prompt ({num_prompt} tokens) + max_tokens "
            f"({params.max_tokens}) exceeds the model's context of {limit} tokens")
    return dataclasses.replace(params, max_tokens=room)
