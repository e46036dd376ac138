"""A streaming OpenAI chat client: the same code measures mlx_lm.server and Fleet's gateway.

A stream's first token is its first SSE chunk with non-empty content (mlx_lm.server sends
nothing else before it; Fleet's gateway sends a role-only opening chunk first, which does not
count). The token count is the `usage` the server reports (stream_options.include_usage).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from bench.workload import Request, StreamResult, closed_loop

MAX_ATTEMPTS = 3


class OpenAIStreamPath:
    def __init__(self, name: str, base_url: str, model: str | None) -> None:
        """`model` None leaves the field out (mlx_lm.server would look it up on the hub)."""
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=10.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    def body(self, request: Request) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": request.messages,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "logit_bias": {str(k): v for k, v in request.logit_bias.items()},
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    async def stream(self, request: Request, t0: float) -> StreamResult:
        """One streamed request. A connection that fails before the response starts is
        retried (twice at most, as the `openai` client does); the wait stays in the TTFT."""
        body = self.body(request)
        result = StreamResult(start_s=time.perf_counter() - t0)
        for attempt in range(MAX_ATTEMPTS):
            try:
                await self._read(body, result, t0)
                break
            except httpx.TransportError as exc:
                result.error = f"{type(exc).__name__}: {exc}"
                if result.first_s is not None or attempt == MAX_ATTEMPTS - 1:
                    break
                result.error = None
                result.extra["retries"] = attempt + 1
        return result

    async def _read(self, body: dict[str, Any], result: StreamResult, t0: float) -> None:
        counted = 0
        async with self.client.stream(
            "POST", f"{self.base_url}/chat/completions", json=body
        ) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if usage := chunk.get("usage"):
                    result.tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = usage.get("prompt_tokens")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter() - t0
                        result.first_s = now if result.first_s is None else result.first_s
                        result.last_s = now
                        counted += 1
        if not result.tokens:
            result.tokens = counted
        result.extra["chunks"] = counted

    async def burst(self, requests: list[Request]) -> list[StreamResult]:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(self.stream(r, t0) for r in requests)))

    async def clients(self, queues: list[list[Request]]) -> list[StreamResult]:
        return await closed_loop(self.stream, queues)

    async def close(self) -> None:
        await self.client.aclose()
