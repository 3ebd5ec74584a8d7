"""``pdserve bench serve --base-url URL``: the traffic over the OpenAI-compatible HTTP API.

Each request is a streamed ``POST {URL}/v1/completions`` (``prompt`` as token ids or text,
``max_tokens``, ``temperature`` 0, ``ignore_eos``, ``stream_options.include_usage``). Timing
follows the gRPC path: TTFT is the first chunk with a choice, ITL the gaps between later ones
(one chunk per router delta, as vLLM counts them), output tokens from the usage chunk. The
response's ``id`` is the router's request id, so its traces are found the same way. Needs the
``httpx`` package; HTTPS is verified against the system's CAs.
"""

from __future__ import annotations

import json
import time

from pdserve.bench.workload import BenchRequest, RequestOutcome


class HttpCompletions:
    """``async with HttpCompletions(url, model) as http: await http.send(...)``."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        try:
            import httpx  # lazy: optional (a test dependency), for --base-url only
        except ImportError:
            raise ValueError("--base-url needs the httpx package: pip install httpx") from None
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers,
                                         timeout=None)
        self.model = model

    async def __aenter__(self) -> HttpCompletions:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.aclose()

    async def send(self, request: BenchRequest, request_id: str, t0: float,
                   timeout: float) -> RequestOutcome:
        """One streamed completion (``request_id`` is replaced by the server's)."""
        # lazy: a test dependency, needed only by the HTTP rows
        import httpx

        out = RequestOutcome(request_id, request.prompt_len)
        body = {"model": self.model, "prompt": request.prompt, "max_tokens": request.output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        out.start = start - t0
        last = None
        try:
            async with self._client.stream("POST", "/v1/completions", json=body,
                                           timeout=timeout) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    out.error = f"HTTP {response.status_code}: {text[:200]}"
                    out.e2el = time.perf_counter() - start
                    return out
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    out.request_id = chunk.get("id", out.request_id)
                    now = time.perf_counter()
                    if chunk.get("choices"):
                        if last is None:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                    usage = chunk.get("usage")
                    if usage:
                        out.output_len = usage["completion_tokens"]
                        out.prompt_len = usage["prompt_tokens"]
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        out.e2el = time.perf_counter() - start
        out.success = not out.error and out.output_len > 0
        if not out.success and not out.error:
            out.error = "no tokens"
        return out
