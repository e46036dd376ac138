"""Each API puts the request's session on its task (a stand-in worker reads the task)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from gateway_helpers import StandInWorker, tokens_script

from fleet.wire.tasks import TextGeneration

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "headers", "session"),
    [
        ("/v1/chat/completions", {"messages": HI}, {"X-Session-Id": "h1"}, "h1"),
        ("/v1/chat/completions", {"messages": HI, "user": "u1", "prompt_cache_key": "k1"},
         {}, "k1"),
        ("/v1/chat/completions", {"messages": HI, "user": "u1"}, {"X-Session-Id": "h1"}, "h1"),
        ("/v1/completions", {"prompt": "hi", "user": "u2"}, {}, "u2"),
        ("/v1/responses", {"input": "hi", "prompt_cache_key": "k3"}, {}, "k3"),
        ("/api/chat", {"messages": HI, "stream": False}, {"X-Session-Id": "h4"}, "h4"),
        ("/api/generate", {"prompt": "hi", "stream": False}, {"X-Session-Id": "h5"}, "h5"),
        ("/v1/chat/completions", {"messages": HI}, {}, None),
    ],
)
async def test_the_session_is_on_the_task(
    client: httpx.AsyncClient, worker: StandInWorker, path: str, body: dict[str, Any],
    headers: dict[str, str], session: str | None,
) -> None:
    response, task = await asyncio.gather(
        client.post(path, json={"model": "tiny-llm", **body}, headers=headers),
        worker.answer(tokens_script("hello")),
    )
    assert response.status_code == 200, response.text
    assert isinstance(task, TextGeneration) and task.session == session
