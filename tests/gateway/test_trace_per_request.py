"""One trace per HTTP request over one connection, kept alive as every OpenAI SDK keeps it, or
pipelined: a request (a failed one included) must not leave its trace current for the
requests after it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from gateway_helpers import Script, StandInWorker, tokens_script
from load_helpers import connect

from fleet.wire.events import ErrorReason, OutputEvent, failed
from fleet.wire.tasks import Task
from tests.gateway_process import GatewayProcess

CHAT = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OUTSIDE_TRACE = "0af7651916cd43dd8448eb211c80319c"


def fails_over_the_context(task: Task) -> list[OutputEvent]:
    return [failed(task.task_id, 1.0, ErrorReason.CONTEXT_LENGTH, "prompt too long")]


def trace_of(headers: dict[str, str]) -> str:
    return headers["traceparent"].split("-")[1]


@pytest.fixture
async def gateway(nats_url: str, tmp_path: Path) -> AsyncIterator[str]:
    process = GatewayProcess(nats_url, tmp_path / "gateway")
    try:
        yield await process.listening()
    finally:
        process.stop()


async def test_each_request_on_a_kept_alive_connection_is_a_trace_of_its_own(
    gateway: str, worker: StandInWorker
) -> None:
    connections: set[int] = set()

    async def note_connection(response: httpx.Response) -> None:
        stream = response.extensions["network_stream"]
        connections.add(stream.get_extra_info("client_addr")[1])

    async with httpx.AsyncClient(
        base_url=gateway, timeout=30, event_hooks={"response": [note_connection]}
    ) as http:
        async def ask(script: Script, headers: dict[str, str] | None = None) -> int:
            response, _ = await asyncio.gather(
                http.post("/v1/chat/completions", json=CHAT, headers=headers),
                worker.answer(script),
            )
            return response.status_code

        assert await ask(fails_over_the_context) == 400
        assert await ask(fails_over_the_context) == 400
        assert await ask(tokens_script("a", "b")) == 200
        assert await ask(tokens_script("c")) == 200
        outside = {"traceparent": f"00-{OUTSIDE_TRACE}-b7ad6b7169203331-01"}
        assert await ask(tokens_script("d"), outside) == 200
        assert await ask(tokens_script("e")) == 200

    assert len(connections) == 1, "the requests did not share one connection"
    traces = [trace_of(headers) for headers in worker.headers]
    assert traces[4] == OUTSIDE_TRACE  # a client's own traceparent is joined
    assert len(set(traces)) == len(traces), traces


async def test_pipelined_requests_are_traces_of_their_own(
    gateway: str, worker: StandInWorker
) -> None:
    """HTTP/1.1 pipelining: uvicorn starts the next request from inside the previous one's
    task (where that request's span is current)."""
    body = orjson.dumps(CHAT)
    one = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: "
           b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    reader, writer = await connect(gateway.removeprefix("http://"))
    writer.write(one * 3)
    for script in (fails_over_the_context, tokens_script("a"), tokens_script("b")):
        await worker.answer(script)
    answers = b""
    while answers.count(b"HTTP/1.1 ") < 3 or not answers.endswith(b"}"):
        answers += await asyncio.wait_for(reader.read(65536), 30)
    writer.close()
    assert re.findall(rb"HTTP/1.1 (\d+)", answers) == [b"400", b"200", b"200"]
    traces = [trace_of(headers) for headers in worker.headers]
    assert len(set(traces)) == len(traces), traces
