"""The OpenAI-compatible HTTP front door: FastAPI on uvicorn, on the router's event loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET
/health`` (200 while serving, else 503: draining, or no worker ready yet; ``/v1/models`` answers
the same 503 until ready; it lists the LoRA adapters beside the model), ``GET /version``, and
the operator's ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` (vLLM's bodies;
the admin key, as gRPC Admin, never an API key: ``http_asgi.Guard``; they go to the admin
backend, which keeps the cluster's registry). With ``api_key`` (or ``priority_api_keys``) every
other path but ``/health`` and ``/version`` needs ``Authorization: Bearer KEY`` (401 otherwise),
and ``priority`` < 0 a priority key (403, ``param: "priority"``), checked by the same
:class:`pdserve.router.auth.Access` and preparation stage as gRPC; with ``tls`` the port speaks
HTTPS (mutual TLS when the config has a client CA). Bodies above ``max_body_bytes`` (by default
sized from the model's context: ``openai_protocol.max_body_bytes``) are 413 before they are read
whole; a request whose head and body have not arrived within ``read_timeout_s`` is 408 and its
connection closed, before the key is checked (``http_asgi.ReadBoundProtocol``), so slow clients
cannot hold the ``max_concurrency`` connections; with keys, a request counts under its key's
tenant for fair turns (``auth.request_tenant``); a body larger than
``openai_protocol.INLINE_PARSE_BYTES`` is parsed in a thread, so parsing never holds the event
loop that every stream shares. A 429 carries ``Retry-After``.
The wire format (fields, chunks, error envelope) is ``pdserve.router.openai_protocol``.

Life of a generation (``_completion_job`` / ``_chat_job``, then
``pdserve.router.http_generation``), the same steps as the gRPC servicer's:

1. Translate in the handler: model name (the served one, or a LoRA adapter's, whose
   ``AdapterRef`` the request then carries; 404 ``model_not_found`` otherwise), unsupported
   parameters (400), ``accepting()`` (503 while draining; a backend not ready yet is no
   refusal: the router waits for a ready worker up to the deadline), sampling fields, the
   prompt's shape; a chat is rendered to token ids here (through ``tools``, in a thread, its
   text size checked first). Then the preparation stage (``pdserve.router.prepare``), as on
   gRPC: priority, tenant, max_tokens, tokenizing a text prompt, the context (an absent
   max_tokens is 16 for completions, for chat the whole context, lowered to what fits). Every
   failure is the OpenAI error envelope, the parameter named.
2. The response object runs the generation as its own asyncio task beside a task that waits
   for the client to disconnect. The first delta is awaited before any byte is sent, so an
   admission failure (429 queue full, 503 no workers, 504 deadline) is an HTTP status.
3. ``stream: true``: SSE ``data: {json}`` chunks, then ``data: [DONE]``; with
   ``stream_options.include_usage`` one more chunk before it with empty ``choices`` and the
   usage (every other chunk says ``usage: null``, or with vLLM's
   ``stream_options.continuous_usage_stats`` the usage so far). A failure after the first
   byte is a ``data: {"error": ...}`` event and no ``[DONE]``. Otherwise one JSON object at
   the end.
4. A disconnect cancels the generation task; whatever ends the stream, its ``finally``
   closes the backend's stream (shielded), which, ended early, aborts the request and frees
   the KV on both workers.

The server must be started on the loop the backend lives on (the router actor's):
:meth:`HttpServer.start` runs uvicorn there as a task, on a socket bound to exactly ``host``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import pdserve
from pdserve.router import openai_protocol as oa
from pdserve.router.adapters import ServedAdapters, resolve_model
from pdserve.router.admin_server import (
    AdminBackend,
    AdminUnavailableError,
    LoraDisabledError,
    UnknownAdapterError,
)
from pdserve.router.auth import CALLER, Access, TLSConfig
from pdserve.router.backend import GenerationBackend
from pdserve.router.errors import (
    NOT_READY,
    DeadlineExceededError,
    NoWorkersError,
    RequestValidationError,
)
from pdserve.router.http_asgi import (
    Guard,
    QuietServer,
    ReadBoundProtocol,
    TaskResponse,
    listening_socket,
)
from pdserve.router.http_generation import HttpGeneration, HttpJob
from pdserve.router.otel import RequestOrigin
from pdserve.router.prepare import prepare
from pdserve.router.tool_calling import ToolCalling, ToolCallParser, tool_calling_of
from pdserve.router.validation import ClientRequest, check_prompt_text
from pdserve.worker_api.adapters import AdapterRef
from pdserve.worker_api.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WORK_THREADS = 2  # large bodies parsed and chats rendered at once
READ_TIMEOUT_S = 30.0  # a request's head and body must arrive within this (ReadBoundProtocol)
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection is closed after this

class PromptTools(Protocol):
    """What the HTTP front door needs of the model's tokenizer (the router actor's)."""

    has_chat_template: bool  # False: chat is a 400, completions still serve
    tool_call_parser: ToolCallParser | None  # reads the model's tool calls (None: none known)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                    tools: list[dict] | None = None) -> list[int]:
        """Prompt token ids of a conversation, ``tools`` shown to the model (ValueError for
        one the template refuses)."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs."""
        ...


class HttpServer:
    """The FastAPI app and its uvicorn server; create, ``start`` and ``stop`` it on one loop."""

    def __init__(self, backend: GenerationBackend, *, model_root: str = "",
                 tools: PromptTools | None = None,
                 accepting: Callable[[], None] | None = None, api_key: str | None = None,
                 tls: TLSConfig | None = None, max_body_bytes: int | None = None,
                 max_concurrency: int | None = None,
                 priority_api_keys: tuple[str, ...] = (),
                 read_timeout_s: float = READ_TIMEOUT_S,
                 adapters: ServedAdapters | None = None, admin: AdminBackend | None = None,
                 admin_api_key: str | None = None) -> None:
        if not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        self._backend = backend
        self._model_root = model_root  # also accepted as the model's name (never shown)
        self._adapters = adapters  # LoRA adapters a request's model may name (None: none)
        self._admin = admin  # loads and unloads adapters (None: the admin paths are 404)
        if max_body_bytes is None:
            max_body_bytes = oa.max_body_bytes(backend.model_info().max_context_tokens)
        self._tools = tools  # chat template and token text; None: no chat, no logprob text
        self._generation = HttpGeneration(backend, tools)
        self._accepting = accepting or _always  # raises NoWorkersError while draining
        self._tls = tls
        self._max_concurrency = max_concurrency  # open connections, at most (uvicorn's)
        self._read_timeout_s = read_timeout_s
        self._started_at = oa.now()
        # bodies parsed and chats rendered on threads of their own, off the loop and off its
        # default pool (which the worker directory's refresh runs on)
        self._work = ThreadPoolExecutor(WORK_THREADS, thread_name_prefix="pdserve-http")
        self.app = self._build_app()
        access = Access(() if api_key is None else (api_key,), admin_api_key,
                        priority_keys=priority_api_keys)
        self.asgi = Guard(self.app, access, max_body_bytes)
        self._server: QuietServer | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None  # bound port once started

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Bind exactly ``host``:``port`` and serve on the running loop; returns the port."""
        if self._task is not None:
            raise RuntimeError("server already started")
        sock = listening_socket(host, port)
        protocol = functools.partial(ReadBoundProtocol, read_timeout_s=self._read_timeout_s)
        config = uvicorn.Config(self.asgi, log_config=None, access_log=False, lifespan="off",
                                http=protocol, ws="none", server_header=False,
                                limit_concurrency=self._max_concurrency,
                                timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=5)
        config.load()
        if self._tls is not None:
            config.ssl = self._tls.ssl_context()
        self._server = QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what failed
                raise RuntimeError(f"HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        logger.info("pdserve HTTP listening on %s:%d%s", host, self.port,
                    " (TLS)" if self._tls else "")
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let requests finish for ``grace`` s, then cut them (which aborts)."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace + 1.0)
        except TimeoutError:
            self._server.force_exit = True
            await self._task
        self._task = self._server = None
        self._work.shutdown(wait=False, cancel_futures=True)
        logger.info("pdserve HTTP server stopped")

    def _check_serving(self) -> None:
        """503 while draining or while no worker is ready (health, the model list)."""
        try:
            self._accepting()
            if not self._backend.is_ready():
                raise NoWorkersError(NOT_READY)
        except NoWorkersError as exc:
            raise oa.OpenAIError(503, str(exc), "service_unavailable") from None

    # -- app ------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdserve", version=pdserve.__version__, docs_url=None,
                      redoc_url=None)

        @app.exception_handler(oa.OpenAIError)
        async def _openai_error(_request, exc: oa.OpenAIError):
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(_request, exc: StarletteHTTPException):
            code = "not_found" if exc.status_code == 404 else None
            return JSONResponse(oa.OpenAIError(exc.status_code, str(exc.detail),
                                               code=code).body(), exc.status_code)

        @app.post("/v1/completions")
        async def completions(request: Request):
            origin = RequestOrigin.of("http", "/v1/completions", request.headers.get)
            body = await self._parse(oa.CompletionRequest, request)
            return await self._guarded(self._completion_job(body, origin))

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            origin = RequestOrigin.of("http", "/v1/chat/completions", request.headers.get)
            body = await self._parse(oa.ChatCompletionRequest, request)
            return await self._guarded(self._chat_job(body, origin))

        @app.get("/v1/models")
        async def models():
            self._check_serving()
            model = self._backend.model_info()
            return oa.model_list(model.model_name, model.max_context_tokens, self._started_at,
                                 self._adapters.all() if self._adapters is not None else ())

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await self._parse(oa.LoadLoraAdapterRequest, request)
            await self._lora_admin("load_lora_adapter", body.lora_name, body.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                     "successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            body = await self._parse(oa.UnloadLoraAdapterRequest, request)
            await self._lora_admin("unload_lora_adapter", body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                     "successfully.")

        @app.get("/health")
        async def health():
            self._check_serving()
            return {}

        @app.get("/version")
        async def version():
            return {"version": pdserve.__version__}

        return app

    async def _parse(self, model, request: Request):
        """The body as ``model`` (400 naming the field), large ones parsed in a thread."""
        raw = await request.body()
        if len(raw) <= oa.INLINE_PARSE_BYTES:
            return oa.parse_body(model, raw)
        return await asyncio.get_running_loop().run_in_executor(self._work, oa.parse_body,
                                                                model, raw)

    async def _guarded(self, making) -> Response:
        try:
            job = await making
            return TaskResponse(lambda send: self._generation.run(job, send), job.request_id)
        except oa.OpenAIError:
            raise
        except Exception as exc:
            error = oa.openai_error(exc)
            if error.status >= 500 and not isinstance(exc, (NoWorkersError,
                                                            DeadlineExceededError)):
                logger.error("preparing a request failed", exc_info=exc)
            raise error from None

    async def _lora_admin(self, method: str, *args) -> None:
        """An adapter admin call (the guard checked the admin key), its refusal as the
        OpenAI envelope: 400 naming ``lora_name``, 404 for an unknown one, 503 when the
        router that keeps the registry does not answer."""
        if self._admin is None:
            raise oa.OpenAIError(404, "this server has no admin backend to load adapters",
                                 code="not_found")
        try:
            await getattr(self._admin, method)(*args)
        except UnknownAdapterError as exc:
            raise oa.OpenAIError(404, str(exc), param="lora_name",
                                 code="model_not_found") from None
        except AdminUnavailableError as exc:
            raise oa.OpenAIError(503, str(exc), "service_unavailable") from None
        except LoraDisabledError as exc:
            raise oa.OpenAIError(400, str(exc), param="lora_name", code="lora_disabled") from None
        except ValueError as exc:
            raise oa.OpenAIError(400, str(exc), param="lora_name",
                                 code="invalid_lora_adapter") from None

    def _check_model(self, name: str) -> AdapterRef | None:
        """The adapter the body's ``model`` names (None: the base model); 404 for others."""
        served = self._backend.model_info().model_name
        return resolve_model("model", name, (served, self._model_root), self._adapters)

    def _sampling(self, body, default_max_tokens: int | None = None
                  ) -> tuple[SamplingParams, ToolCalling | None, AdapterRef | None]:
        """What completions and chat check first: the adapter the body's model names, the
        body's sampling fields and a chat's tool calling."""
        adapter = self._check_model(body.model)
        oa.check_supported(body)
        self._accepting()
        tools = None
        if isinstance(body, oa.ChatCompletionRequest):
            parser = self._tools.tool_call_parser if self._tools is not None else None
            tools = tool_calling_of(body.tools, body.tool_choice, body.parallel_tool_calls,
                                    parser)
        return oa.sampling_params(body, self._backend.model_info().vocab_size,
                                  default_max_tokens, tools), tools, adapter

    async def _completion_job(self, body: oa.CompletionRequest,
                              origin: RequestOrigin | None = None) -> HttpJob:
        params, _, adapter = self._sampling(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise RequestValidationError("prompt", f"one prompt per request, got "
                                                       f"{len(prompt)}")
            prompt = prompt[0]
        job = await self._job(False, "cmpl", body, prompt, "prompt", params, adapter,
                              origin=origin)
        if body.echo:
            job.echo = prompt if isinstance(prompt, str) else "".join(
                map(self._generation.token_text, job.request.prompt_token_ids))
            job.prompt_only = oa.echoes_prompt_only(body)
        return job

    async def _chat_job(self, body: oa.ChatCompletionRequest,
                        origin: RequestOrigin | None = None) -> HttpJob:
        model = self._backend.model_info()
        # chat generates up to the end of the context unless told otherwise
        params, tools, adapter = self._sampling(body,
                                                default_max_tokens=model.max_context_tokens)
        if self._tools is None or not self._tools.has_chat_template:
            raise oa.OpenAIError(400, f"the model {model.model_name!r} has no chat template "
                                      "(tokenizer_config.json chat_template or "
                                      "chat_template.jinja); use /v1/completions",
                                 param="messages", code="no_chat_template")
        if len(body.messages) > model.max_context_tokens:  # each takes a token at least
            raise RequestValidationError("messages", f"{len(body.messages)} messages can never "
                                         f"fit the model's context of "
                                         f"{model.max_context_tokens} tokens")
        messages = oa.chat_messages(body)
        check_prompt_text("messages", "".join(m["content"] for m in messages), model)
        try:
            ids = await asyncio.get_running_loop().run_in_executor(
                self._work, self._tools.render_chat, messages, body.add_generation_prompt,
                tools.template_tools if tools is not None else None)
        except ValueError as exc:
            raise RequestValidationError("messages", f"the chat template refused the "
                                                     f"conversation: {exc}") from None
        return await self._job(True, "chatcmpl", body, ids, "messages", params, adapter,
                               tools, origin)

    async def _job(self, chat: bool, prefix: str, body, prompt: str | list[int],
                   prompt_param: str, params: SamplingParams, adapter: AdapterRef | None,
                   tools: ToolCalling | None = None,
                   origin: RequestOrigin | None = None) -> HttpJob:
        """The body as a ClientRequest, through the preparation stage (``origin``: the
        door's, for traces), as a job to run."""
        max_tokens_param, max_tokens = oa.max_tokens_of(body)
        deadline = None if body.timeout is None else time.monotonic() + body.timeout
        outputs = params.structured_outputs
        incoming = ClientRequest(f"{prefix}-{uuid.uuid4().hex}", prompt, params, max_tokens,
                                 deadline, prompt_field=prompt_param,
                                 max_tokens_field=max_tokens_param,
                                 constraint_field=None if outputs is None
                                 else oa.constraint_field(body, outputs.kind, tools),
                                 adapter=adapter)
        request = await prepare(self._backend, incoming, CALLER.get(), origin)
        model = adapter.name if adapter is not None else self._backend.model_info().model_name
        return HttpJob(chat, model, oa.now(), request, body.stream, body.include_usage, tools,
                       continuous_usage=body.continuous_usage)


def _always() -> None:
    """Accept every request (no draining without the gRPC server's ``check_accepting``)."""
