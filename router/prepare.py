"""The request edge: one preparation stage both front doors call (as vLLM's input processor).

A door translates its wire format into a :class:`~pdserve.router.validation.ClientRequest`
(the gRPC door with ``validation.client_request_from_proto``, the HTTP door from the OpenAI
body, rendering a chat to token ids itself) and checks only what that format alone can tell:
its field shapes, the model's name (resolved to the LoRA adapter it names, if any:
``router.adapters.resolve_model``), draining. Everything else is decided here, once, in this
order, by :func:`prepare`:

1. Priority: ``priority`` < 0 needs a caller that may ask it (``auth.check_priority``;
   PermissionDeniedError naming ``priority``).
2. Tenant: the caller's key's; on a router without keys the one the client claims
   (``auth.request_tenant``).
3. max_tokens, when the client gave it: below the model's context, before any tokenizing.
4. The prompt: a text non-empty and short enough to ever fit (``check_prompt_text``), then
   tokenized by the backend (off the event loop); ids non-empty and inside the vocabulary.
5. The context: the prompt leaves room to generate; prompt + a given max_tokens fit it (else
   an error), an absent one (its ceiling the door's default) is lowered to the room left.
6. The structured output, when the request constrains it: compiled by the backend, bounded in
   time (``backend.check_constraint``, ``router.constraints``); one that does not compile, or
   not in time, is refused naming ``ClientRequest.constraint_field``.

Each failure raises ``RequestValidationError`` naming the field as the client's wire format
spells it (``ClientRequest.prompt_field``, ``max_tokens_field``). The result is one
:class:`~pdserve.router.backend.PreparedRequest`, which ``GenerationBackend.generate`` takes.
Its ``max_tokens`` (None: the client gave none) tells the router core whether, past the KV
cap (``RouterConfig.max_request_kv_fraction``, decided at admission against the live
workers), it lowers ``params.max_tokens`` or refuses the request.
"""

from __future__ import annotations

import dataclasses

from pdserve.router.auth import Caller, check_priority, request_tenant
from pdserve.router.backend import GenerationBackend, ModelSpec, PreparedRequest
from pdserve.router.constraints import ConstraintCheck, ConstraintRefused
from pdserve.router.errors import RequestValidationError
from pdserve.router.otel import RequestOrigin
from pdserve.router.validation import (
    ClientRequest,
    check_max_tokens,
    check_prompt_text,
    check_token_ids,
)
from pdserve.worker_api.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["ClientRequest", "PreparedRequest", "prepare"]


async def prepare(backend: GenerationBackend, request: ClientRequest,
                  caller: Caller | None, origin: RequestOrigin | None = None) -> PreparedRequest:
    """``request`` made ready for ``backend.generate``, for ``caller`` (what the door's auth
    layer found: ``auth.CALLER``), from ``origin`` (the door's, which traces carry); see the
    module docstring for the steps."""
    model = backend.model_info()
    check_priority(request.params.priority, caller)
    tenant = request_tenant(request.claimed_tenant, caller)
    if request.max_tokens is not None:
        check_max_tokens(request.max_tokens_field, request.max_tokens, model)
    prompt_token_ids = await _prompt_token_ids(backend, request, model)
    params = _fit_to_context(request, len(prompt_token_ids), model)
    check = None
    if params.structured_outputs is not None:
        check = await _check_constraint(backend, request, params.structured_outputs)
    return PreparedRequest(request.label, prompt_token_ids, params, request.max_tokens,
                           request.deadline, tenant, check, request.adapter, origin)


async def _check_constraint(backend: GenerationBackend, request: ClientRequest,
                            outputs: StructuredOutputs) -> ConstraintCheck | None:
    try:
        return await backend.check_constraint(outputs)
    except ConstraintRefused as exc:
        field = request.constraint_field or f"structured_outputs.{outputs.kind}"
        raise RequestValidationError(field, str(exc)) from None


async def _prompt_token_ids(backend: GenerationBackend, request: ClientRequest,
                            model: ModelSpec) -> list[int]:
    """The prompt's ids: a text checked for size and tokenized, or ids checked."""
    field, prompt = request.prompt_field, request.prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestValidationError(field, "must be non-empty")
        check_prompt_text(field, prompt, model)
        token_ids = list(await backend.tokenize(prompt))
        if not token_ids:
            raise RequestValidationError(field, "tokenizes to no tokens")
        return token_ids
    if not prompt:
        raise RequestValidationError(field, "must hold at least one token id")
    check_token_ids(field, prompt, model.vocab_size)
    return list(prompt)


def _fit_to_context(request: ClientRequest, num_prompt: int,
                    model: ModelSpec) -> SamplingParams:
    """The params to run with: prompt + max_tokens within the model's context."""
    limit, params = model.max_context_tokens, request.params
    if num_prompt >= limit:
        raise RequestValidationError(
            request.prompt_field, f"prompt has {num_prompt} tokens but the model's context "
            f"is {limit}, leaving no room to generate")
    room = limit - num_prompt
    if params.max_tokens <= room:
        return params
    if request.max_tokens is not None:
        raise RequestValidationError(
            request.max_tokens_field, f"prompt ({num_prompt} tokens) + max_tokens "
            f"({params.max_tokens}) exceeds the model's context of {limit} tokens")
    return dataclasses.replace(params, max_tokens=room)
