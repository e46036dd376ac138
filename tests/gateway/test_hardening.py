"""Attacks on the gateway that must now do no harm: a poisoned image, an oversized prompt,
slow and vanishing clients, idle event streams. Real nats-server; uvicorn with the gateway's
own HTTP protocol where sockets matter."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import orjson
import pytest
import uvicorn
from gateway_helpers import sse_blocks
from nats.aio.client import Client
from starlette.applications import Starlette
from test_images_api import png

from fleet.bus.connect import js_publish
from fleet.config import Settings
from fleet.gateway.app import build_app, server_options
from fleet.wire import subjects
from fleet.wire.events import TaskAccepted, TaskFinished, TokenChunk

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}]}


async def test_an_image_stored_under_a_wrong_name_is_refused_and_logged(
    client: httpx.AsyncClient, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    victim_name = hashlib.sha256(png("red")).hexdigest()
    poison = png("black")
    store = await nc.jetstream().object_store(subjects.IMAGES_BUCKET)
    await store.put(victim_name, poison)  # raw nats-py: any client with write access could

    response = await client.get(f"/v1/images/{victim_name}")
    assert response.status_code == 502, response.text
    assert response.content != poison and response.json()["error"]["code"] == "image_corrupt"
    assert "immutable" not in response.headers.get("cache-control", "")
    assert f"refused to serve image {victim_name}" in caplog.text


async def test_a_prompt_over_the_brokers_message_size_is_413_before_any_publish(
    settings: Settings, nc: Client
) -> None:
    app = build_app(replace(settings, gateway_max_body_bytes=32 * 1024**2))
    prompt = "x" * (5 * 1024**2)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            body = {**CHAT, "messages": [{"role": "user", "content": prompt}]}
            response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 413, response.text
    assert "max_payload" not in response.text or "bytes" in response.text
    tasks = await nc.jetstream().stream_info(subjects.TASKS_STREAM)
    assert tasks.state.messages == 0  # nothing was published


@pytest.fixture
def hardened_settings(settings: Settings) -> Settings:
    return replace(
        settings, gateway_header_timeout_s=0.5, gateway_body_timeout_s=0.5,
        gateway_events_idle_s=0.5, gateway_max_connections=64,
    )


@pytest.fixture
async def hardened(hardened_settings: Settings, nc: Client) -> AsyncIterator[str]:
    """The app on a socket, on uvicorn with the gateway's HTTP protocol and limits."""
    app: Starlette = build_app(hardened_settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    config = uvicorn.Config(
        app, log_level="warning", loop="asyncio", **server_options(hardened_settings)
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    await serving
    sock.close()


class LineWatcher(logging.Handler):
    """Sets an event when a log line containing `text` is emitted."""

    def __init__(self, text: str, seen: asyncio.Event) -> None:
        super().__init__()
        self.text = text
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


async def open_raw(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.split(":")
    return await asyncio.open_connection(host, int(port))


async def test_slow_headers_and_slow_bodies_are_cut_off(hardened: str) -> None:
    idle_reader, _idle = await open_raw(hardened)  # says nothing at all
    slow_reader, slow = await open_raw(hardened)
    slow.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # never ends its headers
    body_reader, body = await open_raw(hardened)
    body.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
               b"content-type: application/json\r\n\r\n{\"model\"")
    async with asyncio.timeout(10):
        assert await idle_reader.read() == b""
        assert await slow_reader.read() == b""
        answer = await body_reader.read()
    assert answer.startswith(b"HTTP/1.1 408"), answer


async def test_too_many_connections_get_429_not_503(
    hardened: str, hardened_settings: Settings
) -> None:
    held = [await open_raw(hardened) for _ in range(hardened_settings.gateway_max_connections)]
    reader, _writer = await open_raw(hardened)
    async with asyncio.timeout(10):
        answer = await reader.read()
    assert answer.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in answer
    for _, held_writer in held:
        held_writer.close()


async def test_a_client_hanging_up_mid_upload_is_one_line(
    hardened: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    logged = asyncio.Event()
    watcher = LineWatcher("client hung up", logged)
    logging.getLogger("fleet.gateway").addHandler(watcher)
    _reader, writer = await open_raw(hardened)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n"
                 b"content-type: application/json\r\n\r\n{\"model\"")
    await writer.drain()
    writer.close()
    try:
        async with asyncio.timeout(10):
            await logged.wait()
    finally:
        logging.getLogger("fleet.gateway").removeHandler(watcher)
    assert "Traceback" not in caplog.text and "Exception in ASGI" not in caplog.text


async def test_resume_stitches_stored_and_live_events_exactly_once(
    hardened: str, nc: Client
) -> None:
    js = nc.jetstream()
    task_id = "stitch-1"
    await js_publish(js, subjects.out(task_id), TaskAccepted(
        task_id=task_id, at=1.0, model="m", node_id="n", runner_id="r"))
    for index in range(3):
        await js_publish(js, subjects.out(task_id), TokenChunk(
            task_id=task_id, at=2.0, index=index, token_id=index, text=f"s{index}"))

    async def more() -> None:
        for index in range(3, 40):
            await nc.publish(subjects.out(task_id), orjson.dumps(TokenChunk(
                task_id=task_id, at=2.0, index=index, token_id=index, text=f"l{index}"
            ).model_dump(mode="json")))
        await js_publish(js, subjects.out(task_id), TaskFinished(
            task_id=task_id, at=3.0, status="completed"))

    async with httpx.AsyncClient(base_url=f"http://{hardened}") as http:
        # tokens keep arriving while the resume replays what is stored
        publishing = asyncio.create_task(more())
        response = await http.get(f"/v1/tasks/{task_id}/events")
        await publishing
    blocks = sse_blocks(response.text)
    # accepted, 40 tokens, finished: each once, in order
    assert [int(block["id"]) for block in blocks] == list(range(1, 43))
    texts = [orjson.loads(b["data"]).get("text") for b in blocks if b["event"] == "token"]
    assert texts == [f"s{i}" for i in range(3)] + [f"l{i}" for i in range(3, 40)]
    # a gateway reads a task through a core subscription and read-backs of FLEET_OUT: no
    # consumer is left behind by a request (fleet/gateway/task_feed.py)
    assert await js.consumers_info(subjects.OUT_STREAM) == []


async def test_an_idle_event_stream_ends_after_its_idle_time(hardened: str, nc: Client) -> None:
    await js_publish(nc.jetstream(), subjects.out("quiet-1"), TaskAccepted(
        task_id="quiet-1", at=1.0, model="m", node_id="n", runner_id="r"))  # then nothing
    async with httpx.AsyncClient(base_url=f"http://{hardened}") as http, asyncio.timeout(10):
        response = await http.get("/v1/tasks/quiet-1/events")
    assert response.status_code == 200
    accepted, block = sse_blocks(response.text)
    assert accepted["event"] == "task_accepted"
    assert block["event"] == "error" and orjson.loads(block["data"])["error"]["code"] == "idle"


async def test_a_lone_reader_without_the_gateway_reads_a_task_from_its_start(nc: Client) -> None:
    """`fleet follow` reads one task with TaskEvents and no hub: its own subscription."""
    from fleet.bus.task_events import TaskEvents

    js = nc.jetstream()
    task_id = "lone-1"
    await js_publish(js, subjects.out(task_id), TaskAccepted(
        task_id=task_id, at=1.0, model="m", node_id="n", runner_id="r"))
    deadline = asyncio.get_running_loop().time() + 10
    async with TaskEvents(js, task_id, deadline) as events:
        await js_publish(js, subjects.out(task_id), TaskFinished(
            task_id=task_id, at=3.0, status="completed"))
        seen = [(item.index, item.event.type) async for item in events]
    assert seen == [(1, "task_accepted"), (2, "task_finished")]
