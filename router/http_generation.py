"""One prepared generation of the HTTP front door (``pdserve.router.http_server``), run into
its response: the first delta awaited before any byte is sent (an admission failure is an HTTP
status), then SSE chunks or one JSON object, errors in the OpenAI envelope, and at the end
the backend's stream closed (shielded), which aborts the request if it ended early."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

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
class _Choice:
    """One sequence of a generation as the door has it so far."""

    texts: list[str] = field(default_factory=list)  # its text deltas (not streaming)
    logprobs: list[dict] = field(default_factory=list)  # its logprobs objects (not streaming)
    offset: int = 0  # characters of text so far (completions' text_offset)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0  # of its tokens (best_of ranks by it)
    calls: ToolCallStream | None = None  # a streamed chat's tool calls (None: no tools)

    def add(self, delta: GenerationDelta, logprobs: dict | None, keep: bool) -> None:
        """``delta``, whose rendered ``logprobs`` object is given; ``keep``: its text and
        logprobs too (a whole response is being built)."""
        self.offset += len(delta.text)
        self.finish_reason = delta.finish_reason or self.finish_reason
        if delta.logprobs is not None:
            self.cumulative_logprob += sum(top.get(token_id, 0.0) for token_id, top
                                           in zip(delta.token_ids, delta.logprobs, strict=True))
        if keep:
            self.texts.append(delta.text)
            if logprobs is not None:
                self.logprobs.append(logprobs)


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
    continuous_usage: bool = False  # every chunk's usage is the usage so far, not null

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
        """SSE events (streaming) or, last, the whole response object (not streaming); with
        ``n`` (``best_of``) > 1 each delta is its sequence's (``GenerationDelta.index``)."""
        choices = [_Choice(calls=ToolCallStream(job.tools)
                           if job.stream and job.tools is not None else None)
                   for _ in range(job.params.num_sequences)]
        num_left, num_generated = len(choices), 0
        delta = first
        for index, choice in enumerate(choices):  # what every choice starts with
            if job.stream and job.chat:
                yield _event(job, oa.chat_chunk(job.request_id, job.model, job.created,
                                                 {"role": "assistant", "content": ""}, None,
                                                 None, job.include_usage, index), 0)
            if job.echo is not None:  # the prompt first, as one more piece of the output
                lp = self._prompt_logprobs(job, first)
                choice.offset = len(job.echo)
                if job.stream:
                    yield _event(job, oa.completion_chunk(job.request_id, job.model,
                                                           job.created, job.echo, None, lp,
                                                           job.include_usage, index), 0)
                else:
                    choice.texts.append(job.echo)
                    if lp is not None:
                        choice.logprobs.append(lp)
        while True:
            if job.prompt_only and delta.finish_reason != "abort":  # max_tokens 0: "length"
                delta = GenerationDelta([], "", None, delta.finish_reason and "length",
                                        index=delta.index)
            if delta.finish_reason == "abort":
                state["done"] = True
                raise NoWorkersError("the request was aborted by the server")
            ended = delta.finish_reason is not None
            num_left -= ended
            state["done"] = num_left == 0
            num_generated += len(delta.token_ids)
            choice = choices[delta.index]
            lp = self._logprobs(job, delta, choice.offset)
            if job.stream and (delta.text or delta.token_ids or ended):
                if job.chat:
                    for chunk in self._chat_chunks(job, delta, lp, choice.calls, ended):
                        yield _event(job, chunk, num_generated)
                else:
                    yield _event(job, oa.completion_chunk(job.request_id, job.model,
                                                           job.created, delta.text,
                                                           delta.finish_reason, lp,
                                                           job.include_usage, delta.index),
                                 num_generated)
            choice.add(delta, lp, keep=not job.stream)
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
        yield self._whole(job, choices, usage)

    @staticmethod
    def _whole(job: HttpJob, choices: list[_Choice], usage: dict) -> dict:
        """The response object of a job not streamed: its choices (best_of: the n of highest
        cumulative logprob), a chat's with the tool calls its text makes."""
        if len(choices) > job.params.n:
            choices = sorted(choices, key=lambda c: c.cumulative_logprob,
                             reverse=True)[:job.params.n]
        body = []
        for index, c in enumerate(choices):
            text = "".join(c.texts)
            merged = oa.merge_logprobs(c.logprobs, job.chat) \
                if job.params.logprobs is not None else None
            if not job.chat:
                body.append(oa.completion_choice(index, text, c.finish_reason, merged))
                continue
            answer, reason = ({"role": "assistant", "content": text}, None) \
                if job.tools is None else message(job.tools, text)
            body.append(oa.chat_choice(index, answer, reason or c.finish_reason, merged))
        build_object = oa.chat_object if job.chat else oa.completion_object
        return build_object(job.request_id, job.model, job.created, body, usage)

    @staticmethod
    def _chat_chunks(job: HttpJob, delta: GenerationDelta, lp: dict | None,
                     calls: ToolCallStream | None, ended: bool) -> list[dict]:
        """The chat chunks one delta makes for its choice: its content, or with tools what
        ``ToolCallStream`` lets out (content, tool_calls); the last chunk of the choice
        carries the finish reason, the first of a delta its logprobs."""
        if calls is None:
            parts = [{"content": delta.text}] if delta.text or delta.token_ids else []
        else:
            parts = calls.feed(delta.text) + (calls.end() if ended else [])
        if not parts and (ended or lp is not None):
            parts = [{}]
        reason = delta.finish_reason
        if calls is not None and reason is not None:
            reason = calls.finish_reason or reason
        return [oa.chat_chunk(job.request_id, job.model, job.created, part,
                              reason if i == len(parts) - 1 else None,
                              lp if i == 0 else None, job.include_usage, delta.index)
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


def _event(job: HttpJob, chunk: dict, num_generated: int) -> bytes:
    """``chunk`` as an SSE event; with ``continuous_usage`` its usage is the usage so far
    (``num_generated`` tokens of every choice)."""
    if job.continuous_usage:
        chunk["usage"] = oa.usage(len(job.request.prompt_token_ids), num_generated)
    return sse(chunk)
