"""Chat and completions through the gateway against a real nats-server, with a stand-in worker
that answers from a script: this tests the gateway's plumbing, not a model."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest
from gateway_helpers import StandInWorker, sse_blocks, tokens_script

from fleet.wire.events import ErrorChunk, ErrorReason, TaskAccepted, TokenChunk, failed
from fleet.wire.tasks import Task, TextGeneration

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "Capital of France?"}]}


def sse_data(body: str) -> list[dict]:
    return [orjson.loads(b["data"]) for b in sse_blocks(body) if b["data"] != "[DONE]"]


async def test_chat_completion_gathers_the_tokens(
    client: httpx.AsyncClient, worker: StandInWorker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "fleet.gateway.access")
    response, task = await asyncio.gather(
        client.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "max_tokens": 7}),
        worker.answer(tokens_script("Par", "is", ".")),
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == task.task_id
    assert response.headers["x-fleet-task-id"] == task.task_id
    [line] = [r.getMessage() for r in caplog.records if r.name == "fleet.gateway.access"]
    assert '"POST /v1/chat/completions" 200 ' in line and line.endswith(f"task={task.task_id}")
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Paris.",
        "refusal": None,
    }
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert isinstance(task, TextGeneration)
    assert (task.temperature, task.max_tokens) == (0.0, 7)
    assert task.deadline is not None


async def test_streamed_chat_ends_with_usage_and_done(
    client: httpx.AsyncClient, worker: StandInWorker
) -> None:
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    response, _ = await asyncio.gather(
        client.post("/v1/chat/completions", json=request),
        worker.answer(tokens_script("Par", "is", finish="length")),
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-fleet-task-id"].startswith("chatcmpl-")
    assert response.text.endswith("data: [DONE]\n\n")
    ids = [b.get("id") for b in sse_blocks(response.text)]
    assert ids == [None, "2", "3", "4", "4", None]  # opening, tokens, finish + usage, [DONE]
    chunks = sse_data(response.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Paris"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 2


async def test_completion_streams_text(client: httpx.AsyncClient, worker: StandInWorker) -> None:
    request = {"model": "tiny-llm", "prompt": "The capital of France is", "stream": True}
    response, task = await asyncio.gather(
        client.post("/v1/completions", json=request), worker.answer(tokens_script(" Paris"))
    )
    assert response.status_code == 200
    texts = [chunk["choices"][0]["text"] for chunk in sse_data(response.text)]
    assert "".join(texts) == " Paris"
    assert isinstance(task, TextGeneration) and task.prompt == "The capital of France is"
    assert task.max_tokens == 16  # OpenAI's default for completions


def _fails_with(reason: ErrorReason, message: str):
    def script(task: Task) -> list:
        accepted = TaskAccepted(
            task_id=task.task_id, at=1.0, model=task.model, node_id="n", runner_id="r"
        )
        error = ErrorChunk(task_id=task.task_id, at=2.0, reason=reason, message=message)
        return [accepted, error, failed(task.task_id, 3.0, reason, message)]

    return script


async def test_a_failed_task_is_an_error_with_its_status(
    client: httpx.AsyncClient, worker: StandInWorker
) -> None:
    response, task = await asyncio.gather(
        client.post("/v1/chat/completions", json={**CHAT, "stream": True}),
        worker.answer(_fails_with(ErrorReason.CONTEXT_LENGTH, "prompt too long")),
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"  # OpenAI's code
    assert response.json()["error"]["fleet_code"] == "context_length"  # and Fleet's
    assert response.json()["error"]["param"] == "messages"
    assert response.json()["error"]["message"] == "prompt too long"
    assert response.headers["x-fleet-task-id"] == task.task_id  # an error names its task too

    response, task = await asyncio.gather(
        client.post("/v1/chat/completions", json=CHAT),
        worker.answer(_fails_with(ErrorReason.RUNNER_CRASHED, "runner exited with -9")),
    )
    assert response.status_code == 502
    assert response.json()["error"]["type"] == "server_error"
    assert response.headers["x-fleet-task-id"] == task.task_id


def _fails_after_a_token(task: Task) -> list:
    accepted = TaskAccepted(task_id=task.task_id, at=1.0, model=task.model, node_id="n",
                            runner_id="r")
    began = TokenChunk(task_id=task.task_id, at=2.0, index=0, token_id=0, text="Par")
    return [accepted, began, failed(task.task_id, 3.0, ErrorReason.RUNNER_CRASHED, "died")]


async def test_a_failure_mid_stream_ends_each_api_in_its_own_way(
    client: httpx.AsyncClient, worker: StandInWorker
) -> None:
    responses, _ = await asyncio.gather(
        client.post("/v1/responses", json={"model": "tiny-llm", "input": "hi", "stream": True}),
        worker.answer(_fails_after_a_token),
    )
    assert responses.status_code == 200
    last = sse_blocks(responses.text)[-1]
    assert last["event"] == "response.failed"
    assert orjson.loads(last["data"])["response"]["error"]["code"] == "runner_crashed"

    chat, _ = await asyncio.gather(
        client.post("/v1/chat/completions", json={**CHAT, "stream": True}),
        worker.answer(_fails_after_a_token),
    )
    last = sse_blocks(chat.text)[-1]
    assert last["event"] == "error"  # OpenAI's SDKs raise on it
    assert orjson.loads(last["data"])["error"]["code"] == "runner_crashed"
