"""A Messages stream whose first token is slow (a long prefill) is committed early, with
message_start and pings, then carries the task's events; a failure after the commit is an
`error` event; a client that leaves before the first token cancels the task. Against a real
nats-server, the gateway on a socket, and a stand-in worker that answers when told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from gateway_helpers import StandInWorker, tokens_script
from nats.aio.client import Client

from fleet.gateway import messages_stream
from fleet.wire import subjects
from fleet.wire.codec import decode_model
from fleet.wire.events import ErrorReason, OutputEvent, TaskAccepted, TaskFinished
from fleet.wire.tasks import CancelTask, Task

ASKED = {"model": "tiny-llm", "max_tokens": 8, "stream": True,
         "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(autouse=True)
def commit_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every stream is "slow": committed before the worker has even taken the task.
    monkeypatch.setattr(messages_stream, "EARLY_COMMIT_S", 0.0)


async def events_of(lines: AsyncIterator[str], until: str | None = None) -> list[dict]:
    """The stream's event data, read up to (and with) the first of type `until`, or to the end."""
    seen = []
    async for line in lines:
        if line.startswith("data: "):
            seen.append(orjson.loads(line[6:]))
            if seen[-1]["type"] == until:
                break
    return seen


async def test_a_slow_stream_opens_at_once_then_carries_the_answer(
    served: str, worker: StandInWorker
) -> None:
    async with (
        httpx.AsyncClient(base_url=served) as http,
        http.stream("POST", "/v1/messages", json=ASKED) as response,
    ):
        assert response.status_code == 200 and response.headers["x-fleet-task-id"]
        lines = response.aiter_lines()
        opening = await events_of(lines, until="ping")  # no task was even taken yet
        await worker.answer(tokens_script("Hel", "lo"))
        rest = await events_of(lines)
    assert [e["type"] for e in opening] == ["message_start", "ping"]
    kinds = [e["type"] for e in rest if e["type"] != "ping"]
    assert kinds == ["content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in rest if e["type"] == "content_block_delta") == (
        "Hello")


def too_long(task: Task) -> list[OutputEvent]:
    return [
        TaskAccepted(task_id=task.task_id, at=1.0, model=task.model, node_id="n", runner_id="r"),
        TaskFinished(task_id=task.task_id, at=2.0, status="failed",
                     reason=ErrorReason.CONTEXT_LENGTH, message="the prompt is too long"),
    ]


async def test_a_failure_after_the_commit_is_an_error_event(
    served: str, worker: StandInWorker
) -> None:
    async with (
        httpx.AsyncClient(base_url=served) as http,
        http.stream("POST", "/v1/messages", json=ASKED) as response,
    ):
        lines = response.aiter_lines()
        await events_of(lines, until="ping")
        await worker.answer(too_long)
        rest = await events_of(lines)
    assert rest[-1]["type"] == "error"
    assert rest[-1]["error"]["type"] == "invalid_request_error"
    assert "too long" in rest[-1]["error"]["message"]


async def test_a_client_that_leaves_before_the_first_token_cancels_the_task(
    served: str, nc: Client, worker: StandInWorker
) -> None:
    cancels = await nc.subscribe(subjects.cancel("*"))
    async with (
        httpx.AsyncClient(base_url=served) as http,
        http.stream("POST", "/v1/messages", json=ASKED) as response,
    ):
        await events_of(response.aiter_lines(), until="ping")
        task = await worker.answer(lambda t: too_long(t)[:1])  # accepted, then nothing
    cancel = decode_model(CancelTask, (await cancels.next_msg(timeout=10)).data)
    assert cancel.task_id == task.task_id



async def test_metadata_user_id_is_the_tasks_session_unless_the_header_names_one(
    served: str, worker: StandInWorker
) -> None:
    asked = {**ASKED, "stream": False, "metadata": {"user_id": "conversation-7"}}
    async with httpx.AsyncClient(base_url=served) as http:
        for headers in ({}, {"x-session-id": "from-header"}):
            answered, task = await asyncio.gather(
                http.post("/v1/messages", json=asked, headers=headers),
                worker.answer(tokens_script("ok")),
            )
            assert answered.status_code == 200 and answered.json()["content"][0]["text"] == "ok"
            assert task.session == headers.get("x-session-id", "conversation-7")
