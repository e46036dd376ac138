"""The SSE kit (fleet/gateway/sse.py) through the real gateway on a socket: keep-alives on an
idle stream, and a client that stops reading dropped after the send timeout, its task
cancelled. Which buffers fill first is the kernel's: the gateway's socket here has small
buffers, so that a few hundred KiB of tokens fill them."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
import uvicorn
from gateway_helpers import StandInWorker, tokens_script
from nats.aio.client import Client
from starlette.applications import Starlette

from fleet.bus.connect import js_publish
from fleet.gateway import sse
from fleet.wire import subjects
from fleet.wire.codec import decode_model
from fleet.wire.events import OutputEvent, TaskAccepted
from fleet.wire.tasks import CancelTask, Task

SMALL_BUFFER = 8 * 1024  # the kernel doubles it; accepted sockets inherit it from the listener


@pytest.fixture
async def served_small(app: Starlette) -> AsyncIterator[tuple[str, int]]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    config = uvicorn.Config(app, lifespan="off", log_level="warning", loop="asyncio")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    yield "127.0.0.1", sock.getsockname()[1]
    server.should_exit = True
    await serving
    sock.close()


def big_tokens_unfinished(task: Task) -> list[OutputEvent]:
    """Far more than the buffers hold (~400 KiB), and no end: the task is still running."""
    return tokens_script(*(f"{i:04d}" + "x" * 4000 for i in range(100)))(task)[:-1]


async def test_a_client_that_stops_reading_is_dropped_and_its_task_cancelled(
    served_small: tuple[str, int], nc: Client, worker: StandInWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sse, "SEND_TIMEOUT_S", 0.5)
    cancels = await nc.subscribe(subjects.cancel("*"))
    body = orjson.dumps({"model": "tiny-llm", "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)  # before the window
    client.connect(served_small)
    _, writer = await asyncio.open_connection(sock=client)
    writer.transport.pause_reading()  # a client that reads nothing
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
                 b"content-type: application/json\r\ncontent-length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        task = await worker.answer(big_tokens_unfinished)
        cancel = decode_model(CancelTask, (await cancels.next_msg(timeout=20)).data)
    finally:
        writer.close()
    assert cancel.task_id == task.task_id
    assert "disconnected" in (cancel.reason or "")


async def test_an_idle_stream_gets_keepalive_comments(
    served: str, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.05)
    accepted = TaskAccepted(task_id="task-idle", at=1, model="tiny-llm", node_id="n",
                            runner_id="r")
    await js_publish(nc.jetstream(), subjects.out("task-idle"), accepted)
    seen: list[str] = []
    async with (
        httpx.AsyncClient(base_url=served) as http,
        http.stream("GET", "/v1/tasks/task-idle/events") as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            seen.append(line)
            if line == ": keep-alive":
                break
    assert any(line.startswith("event: task_accepted") for line in seen)
    assert seen[-1] == ": keep-alive"


async def test_a_receive_that_fails_is_logged_and_counts_as_a_hang_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken_receive() -> dict[str, object]:
        raise RuntimeError("the connection's state is gone")

    with caplog.at_level(logging.ERROR, logger="fleet.gateway.sse"):
        await asyncio.wait_for(sse.hung_up(broken_receive), 5.0)  # returns: the client is gone
    assert any("receive failed" in r.getMessage() and r.exc_info for r in caplog.records)
