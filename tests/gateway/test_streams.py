"""Resume from FLEET_OUT, cancel, and cancel on disconnect: the gateway's stream plumbing,
with events published into FLEET_OUT by the test itself."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from gateway_helpers import StandInWorker, sse_blocks, tokens_script
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from fleet.bus.connect import js_publish
from fleet.wire import subjects
from fleet.wire.codec import decode_model
from fleet.wire.events import OutputEvent, TaskAccepted, TaskFinished, TokenChunk
from fleet.wire.tasks import CancelTask, Task

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def sse_events(body: str) -> list[tuple[str, int, dict]]:
    """(event, id, data) of each SSE event in a body."""
    return [(b["event"], int(b["id"]), orjson.loads(b["data"])) for b in sse_blocks(body)]


async def publish_events(nc: Client, task_id: str, events: list[OutputEvent]) -> None:
    for event in events:
        await js_publish(nc.jetstream(), subjects.out(task_id), event)


def story(task_id: str, texts: list[str]) -> list[OutputEvent]:
    accepted = TaskAccepted(task_id=task_id, at=1, model="tiny-llm", node_id="n", runner_id="r")
    tokens = [
        TokenChunk(task_id=task_id, at=2, index=i, token_id=i, text=t) for i, t in enumerate(texts)
    ]
    return [accepted, *tokens, TaskFinished(task_id=task_id, at=3, status="completed")]


@pytest.mark.parametrize(("after", "expected_ids"), [(0, [1, 2, 3, 4]), (2, [3, 4]), (4, [])])
async def test_events_resume_after_the_ones_seen(
    client: httpx.AsyncClient, nc: Client, after: int, expected_ids: list[int]
) -> None:
    await publish_events(nc, "task-r", story("task-r", ["Par", "is"]))
    await publish_events(nc, "task-other", story("task-other", ["x"]))
    response = await client.get(f"/v1/tasks/task-r/events?after={after}")
    assert response.status_code == 200
    events = sse_events(response.text) if expected_ids else []
    assert [event_id for _, event_id, _ in events] == expected_ids
    assert all(data["task_id"] == "task-r" for _, _, data in events)
    if expected_ids:
        assert events[-1][0] == "task_finished"


async def test_last_event_id_resumes_like_after(client: httpx.AsyncClient, nc: Client) -> None:
    await publish_events(nc, "task-l", story("task-l", ["a", "b", "c"]))
    response = await client.get("/v1/tasks/task-l/events", headers={"last-event-id": "3"})
    assert [event for event, _, _ in sse_events(response.text)] == ["token", "task_finished"]


async def test_cancel_is_recorded_and_announced(client: httpx.AsyncClient, nc: Client) -> None:
    await publish_events(nc, "task-c", story("task-c", ["a"])[:1])  # a task on NATS, running
    announcements = await nc.subscribe(subjects.cancel("task-c"))
    response = await client.post("/v1/tasks/task-c/cancel")
    assert response.status_code == 200
    assert response.json() == {"id": "task-c", "object": "task.cancel", "cancelled": True,
                               "task_ids": ["task-c"]}
    announced = decode_model(CancelTask, (await announcements.next_msg(timeout=5)).data)
    kv = await nc.jetstream().key_value(subjects.CANCELS_BUCKET)
    recorded = decode_model(CancelTask, (await kv.get("task-c")).value)
    assert announced == recorded and announced.task_id == "task-c"


def unfinished(task: Task) -> list[OutputEvent]:
    return tokens_script("Par", "is")(task)[:-1]  # the task is still running


async def _read_first_token_and_hang_up(base_url: str, body: dict) -> None:
    async with (
        httpx.AsyncClient(base_url=base_url) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if '"content":"Par"' in line:
                return  # leaving the block closes the connection mid-stream


async def test_a_client_that_hangs_up_cancels_its_task(
    served: str, nc: Client, worker: StandInWorker
) -> None:
    cancels = await nc.subscribe(subjects.cancel("*"))
    _, task = await asyncio.gather(
        _read_first_token_and_hang_up(served, CHAT), worker.answer(unfinished)
    )
    cancel = decode_model(CancelTask, (await cancels.next_msg(timeout=5)).data)
    assert cancel.task_id == task.task_id
    assert "disconnected" in (cancel.reason or "")


async def test_a_resumable_stream_survives_its_client(
    served: str, client: httpx.AsyncClient, nc: Client, worker: StandInWorker
) -> None:
    _, task = await asyncio.gather(
        _read_first_token_and_hang_up(served, {**CHAT, "resumable": True}),
        worker.answer(unfinished),
    )
    await publish_events(
        nc, task.task_id, [TaskFinished(task_id=task.task_id, at=9, status="completed")]
    )
    # The client saw TaskAccepted and "Par": it resumes after those two events.
    response = await client.get(f"/v1/tasks/{task.task_id}/events?after=2&format=native")
    events = sse_events(response.text)
    assert [(event, data.get("text")) for event, _, data in events] == [
        ("token", "is"),
        ("task_finished", None),
    ]
    kv = await nc.jetstream().key_value(subjects.CANCELS_BUCKET)
    with pytest.raises(KeyNotFoundError):
        await kv.get(task.task_id)


async def test_a_client_that_gives_up_on_a_whole_answer_cancels_its_task(
    served: str, nc: Client, worker: StandInWorker
) -> None:
    cancels = await nc.subscribe(subjects.cancel("*"))
    async with httpx.AsyncClient(base_url=served) as http:
        body = {**CHAT, "stream": False}
        waiting = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        task = await worker.answer(lambda t: unfinished(t)[:1])  # accepted, then nothing
        waiting.cancel()  # the SDK timed out: it closes the connection
        with pytest.raises(asyncio.CancelledError):
            await waiting
    cancel = decode_model(CancelTask, (await cancels.next_msg(timeout=5)).data)
    assert cancel.task_id == task.task_id


@pytest.mark.parametrize("after", [0, 1, 2, 3])
async def test_a_terminal_carrying_its_last_tokens_reads_as_if_they_were_stored_alone(
    client: httpx.AsyncClient, nc: Client, after: int
) -> None:
    accepted, *tokens, end = story("task-t", ["Par", "is", "!"])
    await publish_events(nc, "task-t", [  # issue 23: one message for the last two and the end
        accepted, tokens[0], end.model_copy(update={"last_tokens": tokens[1:]})])
    await publish_events(nc, "task-s", story("task-s", ["Par", "is", "!"]))  # one by one
    carried = await client.get(f"/v1/tasks/task-t/events?after={after}&format=native")
    alone = await client.get(f"/v1/tasks/task-s/events?after={after}&format=native")
    assert carried.status_code == alone.status_code == 200
    assert carried.text == alone.text.replace("task-s", "task-t")  # ids, events, bytes
    assert [event for event, _, _ in sse_events(carried.text)] == [
        "task_accepted", "token", "token", "token", "task_finished"][after:]
