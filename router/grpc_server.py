"""The gRPC front door: ``pdserve.v1.Generation`` over ``grpc.aio``, plus health and reflection.

Life of a Generate call (``GenerationServicer.Generate``):

1. Refuse with UNAVAILABLE while draining. A backend not ready yet is no refusal: the request
   goes on to the backend, which waits for a ready worker (``router.core``) up to the
   request's deadline or its own bound. (Tokenize and GetModelInfo answer UNAVAILABLE until
   the backend is ready, as health does.)
2. Translate the proto (``validation.client_request_from_proto``: request id, an input set,
   every sampling field), then prepare it as the HTTP door does (``pdserve.router.prepare``:
   priority, tenant, max_tokens, tokenizing a text prompt through the backend, the context);
   failures are INVALID_ARGUMENT naming the field (PERMISSION_DENIED for the priority).
3. Iterate ``backend.generate`` and write one response chunk per delta; the first carries the
   request's id (the client's ``request_id``, a label echoed back: two requests may share one,
   and the backend keys nothing on it; the server makes one when none is given), the last
   ``finish_reason`` and usage.
4. Whatever ends the stream, the ``finally`` closes the backend's stream (``end_stream``),
   which aborts the request if it ended early (client cancel, deadline, backend error, server
   stop).

Errors map to codes as listed in ``pdserve.router.errors``; anything else is INTERNAL
(logged with its traceback, not sent to the client). Every failed Generate counts once in
``pdserve_requests_failed_total{code}`` (when the server has metrics).

With ``admin=`` an ``AdminBackend``, the same server also serves ``pdserve.v1.Admin``
(``pdserve.router.admin_server``); reflection lists it.

Health (``grpc.health.v1``) reports, for "" and "pdserve.v1.Generation", SERVING exactly when
the backend is ready and ``set_serving(False)`` (draining) is not in force; a background task
polls ``backend.is_ready()``.

Security (``pdserve.router.auth``, whose module docstring holds the rules): with ``api_key``
(or ``priority_api_keys``) Generation and reflection need metadata ``authorization: Bearer KEY``
(UNAUTHENTICATED otherwise); ``priority`` < 0 needs a priority key (PERMISSION_DENIED, checked by
the preparation stage); Admin needs ``admin_api_key``, or without
one a loopback caller; health is open. With ``tls`` the port speaks TLS
(mutual TLS when the config has a client CA); ``reflection=False`` leaves reflection out;
``max_concurrent_rpcs`` bounds the calls in progress (RESOURCE_EXHAUSTED beyond).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pdserve.api import generation_pb2, generation_pb2_grpc
from pdserve.router.adapters import ServedAdapters
from pdserve.router.admin_server import AdminBackend, add_admin_service
from pdserve.router.auth import CALLER, Access, AccessInterceptor, TLSConfig
from pdserve.router.backend import (
    GenerationBackend,
    GenerationDelta,
    PreparedRequest,
    end_stream,
)
from pdserve.router.errors import (
    NOT_READY,
    DeadlineExceededError,
    NoWorkersError,
    PermissionDeniedError,
    QueueFullError,
    RequestFailedError,
    RequestTooLargeError,
    RequestValidationError,
    UnknownModelError,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.otel import RequestOrigin
from pdserve.router.prepare import prepare
from pdserve.router.validation import check_prompt_text, client_request_from_proto

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
GENERATE_ROUTE = "/pdserve.v1.Generation/Generate"  # what traces name the door by
TENANT_METADATA = "x-pdserve-tenant"  # metadata key naming the tenant when the field is empty
_NO_DEADLINE_S = 1e8  # time_remaining() above this means the client set no deadline

_STATUS_BY_ERROR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (RequestValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkersError, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (RequestFailedError, grpc.StatusCode.INTERNAL),  # with its own message, no traceback
    (UnknownModelError, grpc.StatusCode.NOT_FOUND),
)


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details an exception is returned as."""
    for error_type, code in _STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"


def _response_for(delta: GenerationDelta,
                  request: PreparedRequest) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
    params = request.params
    if delta.logprobs is not None and params.logprobs is not None:
        _add_logprobs(response.logprobs, delta.token_ids, delta.logprobs, params.logprobs)
    if delta.prompt_logprobs is not None and params.prompt_logprobs is not None:
        _add_logprobs(response.prompt_logprobs, request.prompt_token_ids,
                      delta.prompt_logprobs, params.prompt_logprobs)
    return response


def _add_logprobs(entries, token_ids: list[int], logprobs: list[dict[int, float] | None],
                  num_top: int) -> None:
    """One ``TokenLogprobs`` per entry of ``logprobs`` into ``entries``: ``token_ids[i]``'s
    own and the ``num_top`` best; a None entry (a prompt's first token) stays empty."""
    for token_id, top in zip(token_ids, logprobs, strict=True):
        entry = entries.add()
        if top is None:
            continue
        if token_id in top:
            entry.logprob = top[token_id]
        best = sorted(top.items(), key=lambda item: -item[1])[:num_top]
        entry.top.extend(generation_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in best)


async def _abort_with_status(context: grpc.aio.ServicerContext, exc: Exception,
                             what: str, metrics: RouterMetrics | None = None) -> None:
    """End the call with the status ``exc`` maps to (raises ``AbortError``); a Generate
    passes ``metrics`` to count the failure by code."""
    code, details = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, RequestFailedError):
        logger.error("%s failed", what, exc_info=exc)
    else:
        logger.info("%s: %s %s", what, code.name, details)
    if metrics is not None:
        metrics.requests_failed.labels(code.name).inc()
    await context.abort(code, details)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline as a ``time.monotonic()`` instant; None when the client set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining >= _NO_DEADLINE_S:
        return None
    return time.monotonic() + remaining


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Implements the three RPCs against a ``GenerationBackend``."""

    def __init__(self, backend: GenerationBackend, server: GenerationServer,
                 metrics: RouterMetrics | None = None,
                 adapters: ServedAdapters | None = None) -> None:
        self._backend = backend
        self._adapters = adapters  # the LoRA adapters a request's model may name (None: none)
        self._server = server  # asked whether new requests are accepted
        self._metrics = metrics  # failed requests are counted here
        self._num_active = 0  # Generate calls streaming now

    @property
    def num_active_requests(self) -> int:
        return self._num_active

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        try:
            await self._generate(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_with_status(context, exc, f"Generate {request.request_id!r}",
                                     self._metrics)

    async def _generate(self, request: generation_pb2.GenerateRequest,
                        context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        origin = RequestOrigin.of("grpc", GENERATE_ROUTE, metadata.get)
        self._server.check_accepting()
        metadata_tenant = metadata.get(TENANT_METADATA, "")
        incoming = client_request_from_proto(request, self._backend.model_info(),
                                             _deadline(context), metadata_tenant,
                                             self._adapters)
        prepared = await prepare(self._backend, incoming, CALLER.get(), origin)
        self._num_active += 1
        try:
            await self._stream(prepared, context)
        finally:
            self._num_active -= 1

    async def _stream(self, request: PreparedRequest,
                      context: grpc.aio.ServicerContext) -> None:
        deltas = self._backend.generate(request)
        request_id, deadline = request.label, request.deadline
        num_left = request.params.num_sequences  # (n > 1: each index ends on its own)
        num_generated = 0
        try:
            first = True
            while num_left:
                delta = await self._next_delta(deltas, deadline)
                if delta is None:
                    raise RuntimeError("backend ended the stream without a finish_reason")
                num_generated += len(delta.token_ids)
                finished = delta.finish_reason is not None
                num_left -= finished
                if not (delta.token_ids or delta.text or finished):
                    continue
                response = _response_for(delta, request)
                response.index = delta.index
                if first:
                    response.request_id = request_id
                    first = False
                if finished:
                    response.finish_reason = delta.finish_reason
                if not num_left:  # the stream's last chunk: every index's tokens
                    response.usage.prompt_tokens = len(request.prompt_token_ids)
                    response.usage.completion_tokens = num_generated
                if not await self._write(context, response, request_id):
                    return
        finally:
            await end_stream(deltas)

    async def _write(self, context: grpc.aio.ServicerContext,
                     response: generation_pb2.GenerateResponse, request_id: str) -> bool:
        """Send one response; False when the call ended under the write (the client went
        away, or the server is stopping and cuts its calls): the stream then ends quietly,
        its request aborted, since nobody is left to tell."""
        try:
            await context.write(response)
            return True
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            if not (self._server.stopping or context.cancelled() or context.done()):
                raise
            logger.info("Generate %r: the call ended before a response was written (%s)",
                        request_id, type(exc).__name__)
            return False

    @staticmethod
    async def _next_delta(deltas: AsyncIterator[GenerationDelta],
                          deadline: float | None) -> GenerationDelta | None:
        try:
            if deadline is None:
                return await deltas.__anext__()
            timeout = max(0.0, deadline - time.monotonic())
            return await asyncio.wait_for(deltas.__anext__(), timeout)
        except StopAsyncIteration:
            return None
        except TimeoutError as exc:
            raise DeadlineExceededError("the request's deadline passed") from exc

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        try:
            self._check_ready()
            check_prompt_text("text", request.text, self._backend.model_info())  # size first
            token_ids = await self._backend.tokenize(request.text)
        except Exception as exc:
            await _abort_with_status(context, exc, "Tokenize")
        return generation_pb2.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(self, request: generation_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generation_pb2.ModelInfo:
        try:
            self._check_ready()
            model = self._backend.model_info()
        except Exception as exc:
            await _abort_with_status(context, exc, "GetModelInfo")
        return generation_pb2.ModelInfo(
            model_name=model.model_name, max_context_tokens=model.max_context_tokens,
            vocab_size=model.vocab_size, eos_token_ids=model.eos_token_ids,
            lora_adapters=[a.name for a in self._adapters.all()] if self._adapters else [])

    def _check_ready(self) -> None:
        if not self._server.backend_ready():
            raise NoWorkersError(NOT_READY)


class GenerationServer:
    """Owns the ``grpc.aio`` server, its health service and the readiness poller.

    Create, ``start`` and ``stop`` it inside one running event loop. ``set_serving`` may be
    called from any thread.
    """

    def __init__(self, backend: GenerationBackend, *, health_poll_interval_s: float = 0.5,
                 max_message_bytes: int = 16 * 1024 * 1024, admin: AdminBackend | None = None,
                 metrics: RouterMetrics | None = None, api_key: str | None = None,
                 tls: TLSConfig | None = None, reflection: bool = True,
                 max_concurrent_rpcs: int | None = None, admin_api_key: str | None = None,
                 priority_api_keys: tuple[str, ...] = (),
                 adapters: ServedAdapters | None = None) -> None:
        if health_poll_interval_s <= 0:
            raise ValueError(f"health_poll_interval_s must be > 0, got {health_poll_interval_s}")
        if max_concurrent_rpcs is not None and max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1 or None, got {max_concurrent_rpcs}")
        self._access = Access(() if api_key is None else (api_key,), admin_api_key,
                              priority_api_keys)
        self._tls = tls
        self._reflection = reflection
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._backend = backend
        self._poll_s = health_poll_interval_s
        self._max_message_bytes = max_message_bytes
        self._admin = admin  # served as pdserve.v1.Admin when set
        self._servicer = GenerationServicer(backend, self, metrics, adapters)
        self._health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None  # set to re-check health at once
        self._poller: asyncio.Task | None = None
        self._draining = False  # set_serving(False) in force
        self._serving = False  # what health reports now
        self._stopping = False  # stop() has begun
        self.port: int | None = None  # bound port once started

    @property
    def is_serving(self) -> bool:
        """What the health service reports now."""
        return self._serving

    @property
    def num_active_requests(self) -> int:
        return self._servicer.num_active_requests

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` has begun (the calls still running are being cut)."""
        return self._stopping

    def check_accepting(self) -> None:
        """Raise ``NoWorkersError`` while draining (a backend not ready is no refusal: requests
        wait for workers there)."""
        if self._draining:
            raise NoWorkersError("server is draining: send the request to another replica")

    def set_serving(self, serving: bool) -> None:
        """``False`` drains: health NOT_SERVING, new Generate calls UNAVAILABLE. ``True`` undoes."""
        self._draining = not serving
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def start(self, host: str = "127.0.0.1", port: int = 50051) -> int:
        """Bind and start serving; returns the bound port (useful with ``port=0``)."""
        if self._server is not None:
            raise RuntimeError("server already started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stopping = False
        server = grpc.aio.server(interceptors=[AccessInterceptor(self._access)], options=[
            ("grpc.so_reuseport", 0),  # a second server on a busy port must fail, not share it
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.max_send_message_length", self._max_message_bytes),
        ], maximum_concurrent_rpcs=self._max_concurrent_rpcs)
        generation_pb2_grpc.add_GenerationServicer_to_server(self._servicer, server)
        services = [SERVICE_NAME]
        if self._admin is not None:
            services.append(add_admin_service(server, self._admin))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._reflection:
            reflection.enable_server_reflection(
                (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME), server)
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else \
            f"{host}:{port}"
        if self._tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, self._tls.grpc_credentials())
        if bound == 0:
            raise RuntimeError(f"could not bind {address}")
        await server.start()
        self._server = server
        self.port = bound
        await self._update_health()
        self._poller = asyncio.create_task(self._poll_health())
        logger.info("pdserve gRPC listening on %s (bound port %d%s%s)", address, bound,
                    ", TLS" if self._tls else "", "" if self._access.is_open else ", API key")
        return bound

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, then stop; calls still running after ``grace`` s are cancelled."""
        if self._server is None:
            return
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
            self._poller = None
        self._serving = False
        self._stopping = True
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        self._server = None
        logger.info("pdserve gRPC server stopped")

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def backend_ready(self) -> bool:
        """``backend.is_ready()``, with an exception counted as not ready."""
        try:
            return bool(self._backend.is_ready())
        except Exception:
            logger.exception("backend.is_ready() failed; reporting not ready")
            return False

    async def _update_health(self) -> None:
        serving = not self._draining and self.backend_ready()
        if serving == self._serving:
            return
        self._serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)
        logger.info("health: %s", "SERVING" if serving else "NOT_SERVING")

    async def _poll_health(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._poll_s)
            except TimeoutError:
                pass
            self._wake.clear()
            await self._update_health()
