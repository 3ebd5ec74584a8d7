"""One prepared generation of the HTTP front door (``pdserve.router.http_server``), run into
its response: the first delta awaited before any byte is sent (an admission failure is an HTTP
status), then SSE chunks or one JSON object, errors in the OpenAI envelope, and at the end
the backend's stream closed (shielded), which aborts the request if it ended early."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.router import openai_protocol as oa
from pdserve.router.backend import (
    GenerationBackend,
    GenerationDelta,
    PreparedRequest,
    end_stream,
)
from pdserve.router.errors import DeadlineExceededError, NoWorkersError
from pdserve.router.http_asgi import SSE_HEADERS, send_json, sse
from pdserve.router.tool_calling import ToolCalling, ToolCallStream, message
from pdserve.worker_api.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class HttpJob:
    """One prepared generation and how to answer it, ready to run."""

    chat: bool  # chat.completion objects (else text_completion)
    model: str  # served model name, echoed in every object
    created: int  # unix time of arrival
    request: PreparedRequest  # what the backend runs (its deadline from the body's timeout)
    stream: bool
    include_usage: bool
    tools: ToolCalling | None = None  # a chat's tool calling (None: no tools)
    echo: str | None = None  # completions' echo: the prompt's text, sent before the output
    prompt_only: bool = False  # echo with max_tokens 0: the one token generated is dropped

    @property
    def request_id(self) -> str:
        """"cmpl-..." / "chatcmpl-...", the response's id (the request's label)."""
        return self.request.label

    @property
    def params(self) -> SamplingParams:
        return self.request.params


class HttpGeneration:
    """Runs validated jobs (:class:`HttpJob`) on ``backend``; ``tools`` (the server's
    ``PromptTools``, or None) gives the text of logprob tokens."""

    def __init__(self, backend: GenerationBackend, tools=None):
        self._backend, self._tools = backend, tools

    async def run(self, job: HttpJob, send) -> None:
        """Run ``job`` and send its response through the ASGI ``send``."""
        deltas = self._backend.generate(job.request)
        state = {"done": False, "started": False}
        try:
            try:
                first = await self._next(deltas, job.request.deadline)
            except Exception as exc:  # admission failed: an HTTP status, no stream
                await self._send_error(send, exc, state)
                return
            stream = self._stream(job, first, deltas, state)
            try:
                if job.stream:
                    await send({"type": "http.response.start", "status": 200,
                                "headers": SSE_HEADERS})
                    state["started"] = True
                    async for event in stream:
                        await send({"type": "http.response.body", "body": event,
                                    "more_body": True})
                    await send({"type": "http.response.body", "body": b""})
                else:
                    items = [item async for item in stream]  # one: the whole object
                    await send_json(send, 200, items[-1])
            except Exception as exc:
                await self._send_error(send, exc, state)
            finally:
                await stream.aclose()
        finally:
            await end_stream(deltas)

    async def _stream(self, job: HttpJob, first: GenerationDelta,
                      deltas: AsyncIterator[GenerationDelta], state: dict) -> AsyncIterator:
        """SSE events (streaming) or, last, the whole response object (not streaming)."""
        texts: list[str] = []
        logprobs: list = []
        num_generated, offset = 0, 0
        delta = first
        calls = ToolCallStream(job.tools) if job.stream and job.tools is not None else None
        if job.stream and job.chat:
            yield sse(oa.chat_chunk(job.request_id, job.model, job.created,
                                     {"role": "assistant", "content": ""}, None, None,
                                     job.include_usage))
        if job.echo is not None:  # the prompt first, as one more piece of the output
            lp = self._prompt_logprobs(job, first)
            offset = len(job.echo)
            if job.stream:
                yield sse(oa.completion_chunk(job.request_id, job.model, job.created,
                                               job.echo, None, lp, job.include_usage))
            else:
                texts.append(job.echo)
                if lp is not None:
                    logprobs.append(lp)
        while True:
            if job.prompt_only and delta.finish_reason != "abort":  # max_tokens 0: "length"
                delta = GenerationDelta([], "", None, delta.finish_reason and "length")
            if delta.finish_reason == "abort":
                state["done"] = True
                raise NoWorkersError("the request was aborted by the server")
            state["done"] = delta.finish_reason is not None
            num_generated += len(delta.token_ids)
            lp = self._logprobs(job, delta, offset)
            offset += len(delta.text)
            if job.stream and (delta.text or delta.token_ids or state["done"]):
                if job.chat:
                    for chunk in self._chat_chunks(job, delta, lp, calls, state["done"]):
                        yield sse(chunk)
                else:
                    yield sse(oa.completion_chunk(job.request_id, job.model, job.created,
                                                   delta.text, delta.finish_reason, lp,
                                                   job.include_usage))
            elif not job.stream:
                texts.append(delta.text)
                if lp is not None:
                    logprobs.append(lp)
            if state["done"]:
                break
            delta = await self._next(deltas, job.request.deadline)
        usage = oa.usage(len(job.request.prompt_token_ids), num_generated)
        if job.stream:
            if job.include_usage:
                yield sse(oa.usage_chunk(job.request_id, job.model, job.created, job.chat,
                                          usage))
            yield b"data: [DONE]\n\n"
            return
        merged = oa.merge_logprobs(logprobs, job.chat) if job.params.logprobs is not None \
            else None
        text = "".join(texts)
        if not job.chat:
            yield oa.completion_object(job.request_id, job.model, job.created, text,
                                       delta.finish_reason, merged, usage)
            return
        answer, reason = ({"role": "assistant", "content": text}, None) if job.tools is None \
            else message(job.tools, text)
        yield oa.chat_object(job.request_id, job.model, job.created, answer,
                             reason or delta.finish_reason, merged, usage)

    @staticmethod
    def _chat_chunks(job: HttpJob, delta: GenerationDelta, lp: dict | None,
                     calls: ToolCallStream | None, done: bool) -> list[dict]:
        """The chat chunks one delta makes: its content, or with tools what
        ``ToolCallStream`` lets out (content, tool_calls); the last chunk of the answer
        carries the finish reason, the first of a delta its logprobs."""
        if calls is None:
            parts = [{"content": delta.text}] if delta.text or delta.token_ids else []
        else:
            parts = calls.feed(delta.text) + (calls.end() if done else [])
        if not parts and (done or lp is not None):
            parts = [{}]
        reason = delta.finish_reason
        if calls is not None and reason is not None:
            reason = calls.finish_reason or reason
        return [oa.chat_chunk(job.request_id, job.model, job.created, part,
                              reason if i == len(parts) - 1 else None,
                              lp if i == 0 else None, job.include_usage)
                for i, part in enumerate(parts)]

    def _prompt_logprobs(self, job: HttpJob, first: GenerationDelta) -> dict | None:
        """The echoed prompt's completions logprobs object (None: logprobs not asked)."""
        if job.params.logprobs is None or first.prompt_logprobs is None:
            return None
        return oa.completion_logprobs(job.request.prompt_token_ids, first.prompt_logprobs,
                                      job.params.logprobs, self.token_text, 0)

    def _logprobs(self, job: HttpJob, delta: GenerationDelta, offset: int) -> dict | None:
        if job.params.logprobs is None or delta.logprobs is None or not delta.token_ids:
            return None
        if job.chat:
            return oa.chat_logprobs(delta.token_ids, delta.logprobs, job.params.logprobs,
                                    self.token_text)
        return oa.completion_logprobs(delta.token_ids, delta.logprobs, job.params.logprobs,
                                      self.token_text, offset)

    def token_text(self, token_id: int) -> str:
        """One token's text (its id as text without the tools)."""
        return self._tools.token_text(token_id) if self._tools is not None else str(token_id)

    @staticmethod
    async def _next(deltas: AsyncIterator[GenerationDelta],
                    deadline: float | None) -> GenerationDelta:
        try:
            if deadline is None:
                return await deltas.__anext__()
            return await asyncio.wait_for(deltas.__anext__(),
                                          max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            raise RuntimeError("backend ended the stream without a finish_reason") from None
        except TimeoutError as exc:
            raise DeadlineExceededError("the request's deadline passed") from exc

    async def _send_error(self, send, exc: Exception, state: dict) -> None:
        error = oa.openai_error(exc)
        if error.status == 500:
            logger.error("generation failed", exc_info=exc)
        else:
            logger.info("generation refused: %s %s", error.status, error.message)
        try:
            if state["started"]:
                await send({"type": "http.response.body", "body": sse(error.body())})
                await send({"type": "http.response.body", "body": b""})
            else:
                await send_json(send, error.status, error.body(),
                                [(k.encode(), v.encode()) for k, v in error.headers().items()])
        except Exception as send_exc:  # noqa: BLE001 - the client is gone
            logger.info("could not send the error: %s", send_exc)
