"""A resumed task answers in the format of the request that made it (its TaskRecord says
which), raw Fleet events on `?format=native`; an unknown id is 404 for resume and cancel; an
n > 1 request is cancelled as a whole."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from gateway_helpers import StandInWorker, sse_blocks, tokens_script
from nats.aio.client import Client

from fleet.wire import subjects
from fleet.wire.codec import decode_model
from fleet.wire.tasks import CancelTask

MESSAGES = [{"role": "user", "content": "hi"}]


async def made(client: httpx.AsyncClient, worker: StandInWorker, path: str, body: dict) -> str:
    """The task id of a request answered "Par", "is" by the stand-in worker."""
    response, _ = await asyncio.gather(
        client.post(path, json={"model": "tiny-llm", **body}),
        worker.answer(tokens_script("Par", "is")),
    )
    assert response.status_code == 200, response.text
    return response.headers["x-fleet-task-id"]


def data_of(body: str) -> list[dict]:
    return [orjson.loads(b["data"]) for b in sse_blocks(body) if b["data"] != "[DONE]"]


async def test_a_chat_resumes_as_chat_chunks_and_natively_on_request(
    client: httpx.AsyncClient, worker: StandInWorker
) -> None:
    task_id = await made(client, worker, "/v1/chat/completions", {"messages": MESSAGES})

    whole = await client.get(f"/v1/tasks/{task_id}/events")
    assert whole.status_code == 200 and whole.text.endswith("data: [DONE]\n\n")
    chunks = data_of(whole.text)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["id"] for c in chunks} == {task_id}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Paris" and chunks[-1]["choices"][0]["finish_reason"] == "stop"

    # The client saw task_accepted and "Par" (ids 1, 2): the rest, without a second opening.
    rest = data_of((await client.get(f"/v1/tasks/{task_id}/events?after=2")).text)
    assert [c["choices"][0]["delta"] for c in rest] == [{"content": "is"}, {}]

    native = sse_blocks((await client.get(f"/v1/tasks/{task_id}/events?format=native")).text)
    assert [b["event"] for b in native] == ["task_accepted", "token", "token", "task_finished"]


async def test_a_completion_resumes_as_text_completion_chunks(
    client: httpx.AsyncClient, worker: StandInWorker
) -> None:
    task_id = await made(client, worker, "/v1/completions", {"prompt": "The capital is"})
    chunks = data_of((await client.get(f"/v1/tasks/{task_id}/events")).text)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Paris"


async def test_a_completion_with_echo_resumes_with_its_prompt_first_once(
    client: httpx.AsyncClient, worker: StandInWorker
) -> None:
    body = {"prompt": "The capital is ", "echo": True}
    task_id = await made(client, worker, "/v1/completions", body)
    chunks = data_of((await client.get(f"/v1/tasks/{task_id}/events")).text)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0] == "The capital is " and "".join(texts) == "The capital is Paris"
    # A client that saw events has its prompt already: only what it did not see follows.
    rest = data_of((await client.get(f"/v1/tasks/{task_id}/events?after=2")).text)
    assert "".join(c["choices"][0]["text"] for c in rest) == "is"


async def test_a_response_resumes_as_responses_events_numbered_as_first_sent(
    client: httpx.AsyncClient, worker: StandInWorker
) -> None:
    task_id = await made(client, worker, "/v1/responses", {"input": "hi"})
    assert task_id.startswith("resp-")
    whole = sse_blocks((await client.get(f"/v1/tasks/{task_id}/events")).text)
    kinds = [b["event"] for b in whole]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    numbers = [orjson.loads(b["data"])["sequence_number"] for b in whole]
    assert numbers == list(range(len(whole)))

    rest = [orjson.loads(b["data"]) for b in sse_blocks(
        (await client.get(f"/v1/tasks/{task_id}/events?after=2")).text)]
    assert rest[0] == {**rest[0], "type": "response.output_text.delta", "delta": "is"}
    done = next(e for e in rest if e["type"] == "response.output_text.done")
    assert done["text"] == "Paris"  # the whole text, though only "is" was sent again
    assert [e["sequence_number"] for e in rest] == numbers[-len(rest):]


@pytest.mark.parametrize("route", ["events", "cancel"])
async def test_an_unknown_task_id_is_404(client: httpx.AsyncClient, route: str) -> None:
    if route == "events":
        response = await client.get("/v1/tasks/never-made/events")
    else:
        response = await client.post("/v1/tasks/never-made/cancel")
    assert response.status_code == 404
    assert "never-made" in response.json()["error"]["message"]


async def test_format_must_be_openai_or_native(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/tasks/any-1/events?format=xml")
    assert response.status_code == 400 and response.json()["error"]["param"] == "format"


async def test_an_n_choice_request_is_cancelled_as_a_whole(
    client: httpx.AsyncClient, nc: Client, worker: StandInWorker
) -> None:
    body = {"model": "tiny-llm", "messages": MESSAGES, "n": 2}
    answered = [worker.answer(tokens_script("a")) for _ in range(2)]
    response, *_ = await asyncio.gather(client.post("/v1/chat/completions", json=body),
                                        *answered)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-fleet-task-id"]
    choices = response.headers["x-fleet-choice-task-ids"].split(",")
    assert choices == [f"{request_id}-0", f"{request_id}-1"]

    cancel = await client.post(f"/v1/tasks/{request_id}/cancel")
    assert cancel.status_code == 200 and cancel.json()["task_ids"] == choices
    kv = await nc.jetstream().key_value(subjects.CANCELS_BUCKET)
    for choice in choices:
        assert decode_model(CancelTask, (await kv.get(choice)).value).task_id == choice

    whole = await client.get(f"/v1/tasks/{request_id}/events")
    assert whole.status_code == 400 and all(c in whole.json()["error"]["message"]
                                            for c in choices)
