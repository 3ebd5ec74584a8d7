"""Python clients for ``pdserve.v1.Generation``: ``PdserveClient`` (blocking) and
``AsyncPdserveClient`` (asyncio).

```python
from pdserve.api.client import PdserveClient
with PdserveClient("127.0.0.1:50051") as client:
    client.wait_ready(timeout=30)
    result = client.generate("Hello", max_tokens=32, temperature=0.0)
    print(result.text, result.finish_reason, result.usage.completion_tokens)
    for chunk in client.generate_stream([1, 2, 3], max_tokens=8, stop=["\\n"]):
        print(chunk.text, end="", flush=True)
```

The prompt is a string or a list of token ids. Sampling keywords mirror ``SamplingParams``
(OpenAI-like): ``max_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
presence_penalty, frequency_penalty, seed, stop (str or list), stop_token_ids, ignore_eos,
logprobs, prompt_logprobs, structured_outputs, logit_bias``; a keyword left as ``None`` is
unset and takes the server's default. ``logit_bias`` maps token ids to biases in [-100, 100].
``prompt_logprobs=k`` returns each prompt token's logprob and the k best at its position
(``GenerateResult.prompt_logprobs``; the first token's is None).
``structured_outputs`` is a dict with one of ``json`` (a schema: a dict or JSON
text), ``json_object`` (True), ``regex``, ``choice`` (a list of strings) or ``grammar``
(EBNF), and the output will match it. ``n`` (1..16) asks for that many completions of one
prefill: chunks carry their ``index``, and ``generate`` returns index 0's result with every
completion's in ``choices`` (``best_of`` above ``n`` is HTTP's only). ``timeout``
(seconds) becomes the gRPC deadline. Every failure is a ``PdserveError`` with the gRPC code.
Leaving a ``generate_stream`` loop early cancels the call, which frees the request's KV.

A server started with an inference key (``--api-key-file`` or ``PDSERVE_API_KEY``: keys are
never command-line flags) needs ``api_key=`` (sent as ``authorization: Bearer`` metadata on
every call); one with TLS needs ``tls=ClientTLS.from_files(ca=..., cert=...,
key=...)``: ``ca`` verifies the server (None: the system roots), ``cert``/``key`` are this
client's own certificate for mutual TLS.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.api import generation_pb2, generation_pb2_grpc

__all__ = ["PdserveError", "Usage", "GenerateChunk", "GenerateResult", "PromptLogprob",
           "ModelInfo", "ClientTLS",
           "PdserveClient", "AsyncPdserveClient", "build_generate_request", "open_channel",
           "auth_metadata"]

_HEALTH_POLL_S = 0.1


class PdserveError(Exception):
    """A failed call: ``code`` is the ``grpc.StatusCode``, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code  # e.g. grpc.StatusCode.INVALID_ARGUMENT
        self.details = details  # names the field for INVALID_ARGUMENT


def _error(exc: grpc.RpcError) -> PdserveError:
    return PdserveError(exc.code(), exc.details() or "")


@dataclass(frozen=True)
class ClientTLS:
    """TLS for a client channel, PEM bytes (see the module docstring)."""

    root_certificates: bytes | None = None  # CA that signed the server's certificate
    certificate_chain: bytes | None = None  # this client's certificate (mutual TLS)
    private_key: bytes | None = None  # its private key

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    @classmethod
    def from_files(cls, ca: str | os.PathLike | None = None, cert: str | os.PathLike | None = None,
                   key: str | os.PathLike | None = None) -> ClientTLS:
        read = lambda path: None if path is None else Path(path).read_bytes()
        return cls(read(ca), read(cert), read(key))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                            self.certificate_chain)


def open_channel(target: str, tls: ClientTLS | None = None,
                 options: Sequence[tuple[str, object]] = (), aio: bool = False):
    """A blocking (or ``aio``) channel to ``target``: TLS when ``tls`` is given."""
    grpc_module = grpc.aio if aio else grpc
    if tls is None:
        return grpc_module.insecure_channel(target, options=list(options))
    return grpc_module.secure_channel(target, tls.credentials(), options=list(options))


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries ``api_key`` (None without one)."""
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # tokens in the prompt
    completion_tokens: int  # tokens generated


@dataclass(frozen=True)
class PromptLogprob:
    """Log-probabilities at one prompt position."""

    logprob: float  # of the prompt token there
    top: dict[int, float]  # the most likely tokens there: id -> logprob


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed response."""

    request_id: str  # set on the first chunk only ("" afterwards)
    token_ids: list[int]  # ids generated since the previous chunk
    text: str  # text those ids add
    logprobs: list[dict[int, float]] | None  # per id: top id -> logprob (when requested)
    finish_reason: str | None  # "stop" | "length" | "abort" on the last chunk, else None
    # (with n > 1: on each completion's last chunk)
    usage: Usage | None  # on the last chunk, else None
    # the first chunk, when prompt_logprobs was asked: one per prompt token (the first None)
    prompt_logprobs: list[PromptLogprob | None] | None = None
    index: int = 0  # which of the n completions (0..n-1) the chunk is of


@dataclass(frozen=True)
class GenerateResult:
    """A whole generation, the chunks concatenated."""

    request_id: str  # the server's id for the request
    text: str  # generated text
    token_ids: list[int]  # generated ids (prompt excluded)
    finish_reason: str | None  # "stop" | "length" | "abort"
    usage: Usage | None  # prompt and completion token counts
    logprobs: list[dict[int, float]] | None  # per generated id, when requested
    prompt_logprobs: list[PromptLogprob | None] | None = None  # per prompt id, when requested
    # with n > 1: every completion's result by index (the fields above are index 0's, but
    # usage, the whole request's); () when n == 1
    choices: tuple[GenerateResult, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    model_name: str  # served model's name
    max_context_tokens: int  # prompt + generated tokens at most
    vocab_size: int  # valid token ids are [0, vocab_size)
    eos_token_ids: list[int]  # ids that end generation unless ignore_eos
    lora_adapters: list[str] = field(default_factory=list)  # LoRA adapters served beside it:
    # the names generate(model=...) takes


def build_generate_request(
        prompt: str | Sequence[int], *, request_id: str = "", max_tokens: int | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, repetition_penalty: float | None = None,
        presence_penalty: float | None = None, frequency_penalty: float | None = None,
        seed: int | None = None, stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None, ignore_eos: bool | None = None,
        logprobs: int | None = None, priority: int | None = None,
        prompt_logprobs: int | None = None, structured_outputs: dict | None = None,
        logit_bias: dict[int, float] | None = None, n: int | None = None,
        best_of: int | None = None, tenant: str = "",
        model: str = "") -> generation_pb2.GenerateRequest:
    """The request proto for a prompt and OpenAI-like sampling keywords (``None`` = unset);
    ``model``: a LoRA adapter's name (``ModelInfo.lora_adapters``), "" for the base model."""
    request = generation_pb2.GenerateRequest(request_id=request_id or "", tenant=tenant or "",
                                             model=model or "")
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.SetInParent()  # an empty list still selects token_ids
        request.token_ids.ids.extend(prompt)
    scalars = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
               "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty,
               "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
               "seed": seed, "ignore_eos": ignore_eos, "logprobs": logprobs,
               "priority": priority, "prompt_logprobs": prompt_logprobs, "n": n,
               "best_of": best_of}
    for name, value in scalars.items():
        if value is not None:
            setattr(request.sampling, name, value)
    if stop is not None:
        request.sampling.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids is not None:
        request.sampling.stop_token_ids.extend(stop_token_ids)
    if structured_outputs is not None:
        target = request.sampling.structured_outputs
        target.SetInParent()  # (an empty dict still sends the field: the server names it)
        for name, value in structured_outputs.items():
            if name == "choice":
                target.choice.choices.extend(value)
            else:
                setattr(target, name, value if name not in ("json", "structural_tag")
                        or isinstance(value, str) else json.dumps(value))
    if logit_bias is not None:
        request.sampling.logit_bias.update(logit_bias)
    return request


def _chunk(response: generation_pb2.GenerateResponse) -> GenerateChunk:
    logprobs = None
    if len(response.logprobs):
        logprobs = [{top.token_id: top.logprob for top in entry.top}
                    for entry in response.logprobs]
        for token_id, entry, top in zip(response.token_ids, response.logprobs, logprobs,
                                        strict=False):
            if entry.HasField("logprob"):
                top.setdefault(token_id, entry.logprob)
    usage = None
    if response.HasField("usage"):
        usage = Usage(response.usage.prompt_tokens, response.usage.completion_tokens)
    prompt_logprobs = None
    if len(response.prompt_logprobs):
        prompt_logprobs = [
            PromptLogprob(entry.logprob, {top.token_id: top.logprob for top in entry.top})
            if entry.HasField("logprob") else None for entry in response.prompt_logprobs]
    return GenerateChunk(request_id=response.request_id, token_ids=list(response.token_ids),
                         text=response.text, logprobs=logprobs,
                         finish_reason=response.finish_reason or None, usage=usage,
                         prompt_logprobs=prompt_logprobs, index=response.index)


class _Collector:
    """Concatenates chunks into a ``GenerateResult`` (those of each index apart, n > 1)."""

    def __init__(self) -> None:
        self.request_id = ""
        self.usage: Usage | None = None
        self.choices: dict[int, _Choice] = {}

    def add(self, chunk: GenerateChunk) -> None:
        self.request_id = self.request_id or chunk.request_id
        self.usage = chunk.usage or self.usage
        self.choices.setdefault(chunk.index, _Choice()).add(chunk)

    def result(self) -> GenerateResult:
        results = [self.choices[i].result(self.request_id, self.usage)
                   for i in sorted(self.choices)] or [_Choice().result(self.request_id,
                                                                       self.usage)]
        return dataclasses.replace(results[0], choices=tuple(results) if len(results) > 1
                                   else ())


class _Choice:
    """One completion's chunks."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = None
        self.prompt_logprobs: list[PromptLogprob | None] | None = None
        self.finish_reason: str | None = None

    def add(self, chunk: GenerateChunk) -> None:
        self.texts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        self.prompt_logprobs = self.prompt_logprobs or chunk.prompt_logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason

    def result(self, request_id: str, usage: Usage | None) -> GenerateResult:
        return GenerateResult(request_id=request_id, text="".join(self.texts),
                              token_ids=self.token_ids, finish_reason=self.finish_reason,
                              usage=usage, logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs)


def _model_info(reply: generation_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(model_name=reply.model_name, max_context_tokens=reply.max_context_tokens,
                     vocab_size=reply.vocab_size, eos_token_ids=list(reply.eos_token_ids),
                     lora_adapters=list(reply.lora_adapters))


def _status_name(reply: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class PdserveClient:
    """Blocking client; ``timeout`` is the default deadline in seconds for every call."""

    def __init__(self, target: str, *, timeout: float | None = None,
                 options: Sequence[tuple[str, object]] = (), api_key: str | None = None,
                 tls: ClientTLS | None = None) -> None:
        self._timeout = timeout
        self._metadata = auth_metadata(api_key)
        self._channel = open_channel(target, tls, options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    def __enter__(self) -> PdserveClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 request_id: str = "", **sampling) -> GenerateResult:
        """Generate to the end and return the concatenated result."""
        collector = _Collector()
        for chunk in self.generate_stream(prompt, timeout=timeout, request_id=request_id,
                                          **sampling):
            collector.add(chunk)
        return collector.result()

    def generate_stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                        request_id: str = "", **sampling) -> Iterator[GenerateChunk]:
        """Yield chunks as the server streams them; breaking out of the loop cancels."""
        request = build_generate_request(prompt, request_id=request_id, **sampling)
        call = self._stub.Generate(request, timeout=self._deadline(timeout),
                                  metadata=self._metadata)
        try:
            for response in call:
                yield _chunk(response)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()  # no-op once the call has finished

    def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        try:
            reply = self._stub.Tokenize(generation_pb2.TokenizeRequest(text=text),
                                        timeout=self._deadline(timeout),
                                        metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return list(reply.token_ids)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            reply = self._stub.GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                            timeout=self._deadline(timeout),
                                            metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return _model_info(reply)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name: "SERVING", "NOT_SERVING", ..."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                       timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return _status_name(reply)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until health is SERVING; ``PdserveError(DEADLINE_EXCEEDED)`` after ``timeout``."""
        end = time.monotonic() + timeout
        last = "UNKNOWN"
        while time.monotonic() < end:
            try:
                last = self.health(timeout=max(0.01, min(1.0, end - time.monotonic())))
                if last == "SERVING":
                    return
            except PdserveError as exc:
                last = exc.code.name
            time.sleep(_HEALTH_POLL_S)
        raise PdserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"server not SERVING after {timeout} s (last: {last})")


class AsyncPdserveClient:
    """asyncio client; create it inside the event loop that uses it."""

    def __init__(self, target: str, *, timeout: float | None = None,
                 options: Sequence[tuple[str, object]] = (), api_key: str | None = None,
                 tls: ClientTLS | None = None) -> None:
        self._timeout = timeout
        self._metadata = auth_metadata(api_key)
        self._channel = open_channel(target, tls, options, aio=True)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    async def __aenter__(self) -> AsyncPdserveClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                       request_id: str = "", **sampling) -> GenerateResult:
        """Generate to the end and return the concatenated result."""
        collector = _Collector()
        async for chunk in self.generate_stream(prompt, timeout=timeout, request_id=request_id,
                                                **sampling):
            collector.add(chunk)
        return collector.result()

    async def generate_stream(self, prompt: str | Sequence[int], *,
                              timeout: float | None = None, request_id: str = "",
                              **sampling) -> AsyncIterator[GenerateChunk]:
        """Yield chunks as the server streams them; leaving early cancels the call."""
        request = build_generate_request(prompt, request_id=request_id, **sampling)
        call = self._stub.Generate(request, timeout=self._deadline(timeout),
                                  metadata=self._metadata)
        try:
            async for response in call:
                yield _chunk(response)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    async def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        try:
            reply = await self._stub.Tokenize(generation_pb2.TokenizeRequest(text=text),
                                              timeout=self._deadline(timeout),
                                              metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return list(reply.token_ids)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            reply = await self._stub.GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                  timeout=self._deadline(timeout),
                                                  metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return _model_info(reply)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's health status name: "SERVING", "NOT_SERVING", ..."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                             timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return _status_name(reply)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until health is SERVING; ``PdserveError(DEADLINE_EXCEEDED)`` after ``timeout``."""
        end = time.monotonic() + timeout
        last = "UNKNOWN"
        while time.monotonic() < end:
            try:
                last = await self.health(timeout=max(0.01, min(1.0, end - time.monotonic())))
                if last == "SERVING":
                    return
            except PdserveError as exc:
                last = exc.code.name
            await asyncio.sleep(_HEALTH_POLL_S)
        raise PdserveError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"server not SERVING after {timeout} s (last: {last})")
